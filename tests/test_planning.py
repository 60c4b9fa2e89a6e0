"""KV memory planning: estimates against the KV buffers llama.cpp really allocates."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llamabatch import BatchEngine
from llamabatch.cli import app
from llamabatch.engine.config import parse_size
from llamabatch.engine.sizing.options import EngineOptions
from llamabatch.engine.sizing.planning import KvShape, current_rss, plan, plan_for

CONFIGS = [  # (n_ctx, n_parallel, kv_unified, n_ubatch)
    (2048, 1, False, 512), (4096, 4, False, 512), (8192, 8, False, 256), (3000, 3, False, 512),
    (2048, 8, True, 512), (1000, 4, True, 128), (20000, 16, True, 512),
]


def within_5_percent(estimate: int, actual: int) -> bool:
    return abs(estimate - actual) <= 0.05 * actual


@pytest.mark.parametrize("n_ctx, n_parallel, kv_unified, n_ubatch", CONFIGS)
def test_estimate_matches_the_tiny_models_allocation(tiny_model, n_ctx, n_parallel, kv_unified, n_ubatch):
    with BatchEngine(tiny_model, n_ctx=n_ctx, n_parallel=n_parallel, kv_unified=kv_unified, n_ubatch=n_ubatch) as engine:
        estimate = KvShape.of(engine.model).kv_bytes(n_ctx, n_parallel, kv_unified, n_ubatch)
        assert engine.ctx.kv_bytes > 0
        assert within_5_percent(estimate, engine.ctx.kv_bytes)


@pytest.mark.real_model
@pytest.mark.parametrize("n_ctx, n_parallel, kv_unified, n_ubatch", CONFIGS)
def test_estimate_matches_the_default_models_allocation(n_ctx, n_parallel, kv_unified, n_ubatch):
    """Gemma 3 mixes full-attention and sliding-window layers, whose caches are sized apart."""
    with BatchEngine(n_ctx=n_ctx, n_parallel=n_parallel, kv_unified=kv_unified, n_ubatch=n_ubatch) as engine:
        shape = KvShape.of(engine.model)
        assert shape.swa_layers > 0 and shape.n_swa > 0
        assert within_5_percent(shape.kv_bytes(n_ctx, n_parallel, kv_unified, n_ubatch), engine.ctx.kv_bytes)


def test_plan_picks_the_largest_parallel_within_the_budget(tiny_model):
    with BatchEngine(tiny_model, n_parallel=1) as engine:
        shape = KvShape.of(engine.model)
        one = plan(engine.model, shape, 1024, budget_bytes=10**12, max_parallel=1)
        per_seq = shape.kv_bytes(2 * 1024, 2, False, 512) - shape.kv_bytes(1024, 1, False, 512) + 4 * engine.vocab.n_vocab
        budget = one.total_bytes + 5 * per_seq + per_seq // 2  # room for 5.5 more sequences
        planned = plan(engine.model, shape, 1024, budget)
    assert planned.n_parallel == 6 and planned.n_ctx == 6 * 1024
    assert planned.total_bytes <= budget < planned.total_bytes + per_seq


def test_plan_never_exceeds_llama_cpps_sequence_limit(tiny_model):
    planned, _ = plan_for(tiny_model, ctx_per_seq=256, memory=10**12)
    assert planned.n_parallel == 256


def test_a_budget_too_small_for_one_sequence_is_refused(tiny_model):
    result = CliRunner().invoke(app, ["plan", "-m", str(tiny_model), "--memory", "1MiB"])
    assert result.exit_code == 1 and "more than the" in result.output


def test_plan_cli_checks_its_estimate_against_llama_cpp(tiny_model):
    # The budget covers the whole process, and this one has run much of the suite: 1 GiB beyond it.
    budget = current_rss() + 2**30
    result = CliRunner().invoke(app, ["plan", "-m", str(tiny_model), "--ctx-per-seq", "512", "--memory", str(budget), "--check", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert row["n_parallel"] >= 1 and row["total_bytes"] <= budget
    assert within_5_percent(row["kv_bytes"], row["allocated_kv_bytes"])


def test_run_parallel_auto_takes_the_measured_batch_size_and_no_more_slots_than_sequences(tiny_model):
    result = CliRunner().invoke(app, ["run", "-m", str(tiny_model), "-p", "a", "-p", "b", "-n", "2", "--parallel", "auto",
                                      "--max-tokens", "3", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.splitlines()[-1])["summary"]
    measured = EngineOptions(model=tiny_model).stored_tuning().choose().batch_size
    assert summary["parallel"] == min(measured, 4)  # the measured batch size, at most one slot per sequence


def test_bad_parallel_and_memory_values_are_named():
    bad_parallel = CliRunner().invoke(app, ["run", "-p", "a", "--parallel", "many"])
    assert bad_parallel.exit_code == 1 and "--parallel must be a number >= 1 or 'auto', got 'many'" in bad_parallel.output
    with pytest.raises(ValueError, match="not a memory size"):
        parse_size("lots")


@pytest.mark.parametrize("text, expected", [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1500", 1500)])
def test_memory_sizes_parse(text, expected):
    assert parse_size(text) == expected
