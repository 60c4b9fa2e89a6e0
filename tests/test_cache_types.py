"""KV cache types and flash attention on real contexts: each type loads, generates, and is planned
to within 5% of the KV buffer llama.cpp allocates; combinations llama.cpp refuses are refused
with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llamabatch import BatchEngine, SamplingParams
from llamabatch.cli import app
from llamabatch.engine.sizing.planning import KvShape, current_rss, plan_for
from llamabatch.errors import ConfigError

from tiny_model import write_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TYPES = [("f16", "f16"), ("f32", "f32"), ("bf16", "bf16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"),
         ("q5_1", "q4_1"), ("iq4_nl", "q5_0")]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    """The tiny model with 32-wide heads: quantized caches pack 32 values a block, and llama.cpp
    refuses a head narrower than a block."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "wide.gguf", n_embd=128, n_head=4)


def within_5_percent(estimate: int, actual: int) -> bool:
    return abs(estimate - actual) <= 0.05 * actual


@pytest.mark.parametrize("type_k, type_v", TYPES)
def test_each_cache_type_loads_generates_and_is_planned(wide_model, type_k, type_v):
    for n_ctx, n_parallel, kv_unified in ((2048, 4, False), (4096, 8, True)):
        with BatchEngine(wide_model, n_ctx=n_ctx, n_parallel=n_parallel, kv_unified=kv_unified, n_threads=2,
                         cache_type_k=type_k, cache_type_v=type_v) as engine:
            results = engine.generate(["hello world", "Once upon a time"], GREEDY)
            assert [r.finish_reason for r in results] == ["length", "length"]
            assert engine.ctx.cache_types == (type_k, type_v)
            assert engine.ctx.flash_attn in ("on", "off")  # auto, as llama.cpp resolved it
            estimate = KvShape.of(engine.model, type_k, type_v).kv_bytes(n_ctx, n_parallel, kv_unified, engine.config.n_ubatch)
            assert within_5_percent(estimate, engine.ctx.kv_bytes), (estimate, engine.ctx.kv_bytes)


def test_quantized_caches_take_less_memory_and_plan_more_sequences(wide_model):
    budget = current_rss() + (32 << 20)  # the budget covers this process too: 32 MiB over it
    plans = {t: plan_for(wide_model, ctx_per_seq=1024, memory=budget, cache_type_k=t, cache_type_v=t)[0]
             for t in ("f16", "q8_0", "q4_0")}
    kv_per_seq = {t: p.kv_bytes / p.n_parallel for t, p in plans.items()}
    assert kv_per_seq["f16"] / kv_per_seq["q8_0"] == pytest.approx(2 / (34 / 32), rel=0.01)
    assert kv_per_seq["f16"] / kv_per_seq["q4_0"] == pytest.approx(2 / (18 / 32), rel=0.01)
    assert plans["f16"].n_parallel < plans["q8_0"].n_parallel < plans["q4_0"].n_parallel


def test_plan_check_compares_with_llama_cpp_for_a_quantized_cache(wide_model):
    budget = str(current_rss() + (16 << 20))
    done = CliRunner().invoke(app, ["plan", "--model", str(wide_model), "--ctx-per-seq", "512", "--memory", budget,
                                    "-ctk", "q8_0", "-ctv", "q4_0", "--check", "--json"])
    assert done.exit_code == 0, done.output
    row = json.loads(done.output.strip().splitlines()[-1])
    assert (row["cache_type_k"], row["cache_type_v"]) == ("q8_0", "q4_0")
    assert within_5_percent(row["kv_bytes"], row["allocated_kv_bytes"])


def test_refused_combinations_are_refused_with_the_reason(make_engine, wide_model, tiny_model, monkeypatch):
    import llamabatch.engine.runtime as runtime

    loads = []
    monkeypatch.setattr(runtime, "Model", lambda *a, **k: loads.append(a))  # nothing may load before the check
    with pytest.raises(ConfigError, match=r"a quantized V cache \(--cache-type-v q8_0\) needs flash attention"):
        make_engine(wide_model, cache_type_v="q8_0", flash_attn="off")
    with pytest.raises(ConfigError, match="--cache-type-k must be one of f32, f16, bf16, q8_0, .*got 'q3_k'"):
        make_engine(wide_model, cache_type_k="q3_k")
    with pytest.raises(ConfigError, match="--flash-attn must be 'auto', 'on' or 'off', got 'yes'"):
        make_engine(wide_model, flash_attn="yes")
    assert loads == []
    monkeypatch.undo()
    # what only llama.cpp knows, quoted from it: the tiny model's 16-wide heads do not hold a 32-value block
    with pytest.raises(ConfigError, match="K cache type q8_0 with block size 32 does not divide n_embd_head_k=16"):
        make_engine(tiny_model, cache_type_k="q8_0")
    with pytest.raises(ConfigError, match="--cache-type-v must be one of"):
        plan_for(wide_model, memory=1 << 30, cache_type_v="int8")
    # flash attention off with an unquantized V is fine
    assert make_engine(wide_model, flash_attn="off").ctx.flash_attn == "off"


def test_sweep_and_metrics_report_the_cache_types(wide_model, serve):
    import httpx

    base = serve(model=wide_model, engine_extra={"cache_type_k": "q8_0", "cache_type_v": "q8_0"})
    metrics = httpx.get(f"{base}/metrics").text
    info = next(line for line in metrics.splitlines() if line.startswith("llamabatch_engine_info{"))
    assert 'cache_type_k="q8_0"' in info and 'cache_type_v="q8_0"' in info and 'flash_attn="on"' in info
    done = CliRunner().invoke(app, ["sweep", "--model", str(wide_model), "--batch-sizes", "1,2", "--prompt-tokens", "8",
                                    "--gen-tokens", "4", "-ctk", "q4_0", "-ctv", "q4_0", "--threads", "2"])
    assert done.exit_code == 0, done.output
    assert "KV q4_0/q4_0" in done.output


@pytest.mark.real_model
@pytest.mark.parametrize("type_k, type_v", [("q8_0", "q8_0"), ("q4_0", "q4_0")])
def test_the_default_models_quantized_cache_is_planned(type_k, type_v):
    """Gemma 3's full-attention and sliding-window layers, each cache in the type asked for."""
    with BatchEngine(n_ctx=8192, n_parallel=8, cache_type_k=type_k, cache_type_v=type_v) as engine:
        estimate = KvShape.of(engine.model, type_k, type_v).kv_bytes(8192, 8, engine.config.kv_unified, engine.config.n_ubatch)
        assert within_5_percent(estimate, engine.ctx.kv_bytes)
        assert engine.generate(["The capital of France is"], GREEDY)[0].finish_reason == "length"
