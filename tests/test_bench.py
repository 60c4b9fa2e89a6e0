"""`llamabatch sweep` on the tiny model: figures by llama-batched-bench's definitions, outputs, baselines."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llamabatch.measure import sweep as bench
from llamabatch.measure.sweep import SweepSettings, measure
from llamabatch.cli import app

REQUIRED = {"batch_size", "s_pp", "s_tg", "s", "ttft_p50_s", "tpot_p50_s", "kv_bytes", "peak_rss_bytes"}


def sweep(*args: str):
    return CliRunner().invoke(app, ["sweep", *map(str, args)])


@pytest.mark.parametrize("shared", [False, True], ids=["own-prompts", "shared-prompt"])
def test_a_measurement_follows_llama_batched_bench_definitions(make_engine, decode_calls, shared):
    settings = SweepSettings(batch_sizes=(4,), prompt_tokens=10, gen_tokens=6, shared_prompt=shared)
    engine = make_engine(n_parallel=4, n_ctx=settings.context, share_prefixes=shared)
    point = measure(engine, settings, 4)
    n_prompt = 10 if shared else 40
    assert engine.stats.prompt_tokens_evaluated == n_prompt  # a shared prompt is decoded once
    assert len(decode_calls) == 1 + 6  # one prefill step, then TG steps of B tokens each
    assert engine.stats.completion_tokens == 4 * 7  # the prefill samples each sequence's first token
    assert point.s_pp == pytest.approx(n_prompt / point.t_pp)
    assert point.s_tg == pytest.approx(4 * 6 / point.t_tg)
    assert point.s == pytest.approx((n_prompt + 4 * 6) / (point.t_pp + point.t_tg))
    # N_KV as llama-batched-bench counts it for the engine's (default, unified) KV: a shared prompt once
    assert engine.config.kv_unified and point.n_kv == (10 if shared else 4 * 10) + 4 * 6
    assert 0 < point.ttft_p50_s <= point.ttft_p99_s and 0 < point.tpot_p50_s <= point.tpot_p99_s


@pytest.mark.fresh_process
def test_deterministic_measurement_prefills_each_prompt_alone_then_decodes_together(make_engine, decode_calls):
    settings = SweepSettings(batch_sizes=(4,), prompt_tokens=10, gen_tokens=6)
    engine = make_engine(n_parallel=4, n_ctx=settings.context, deterministic=True)
    point = measure(engine, settings, 4)
    # B * PP fits in n_batch: four prefill steps back to back, then TG steps of B tokens each
    assert len(decode_calls) == 4 + 6
    assert point.s_tg == pytest.approx(4 * 6 / point.t_tg)


def test_sweep_json_csv_and_plot(tiny_model, tmp_path):
    pytest.importorskip("matplotlib")
    csv, png = tmp_path / "sweep.csv", tmp_path / "sweep.png"
    result = sweep("-m", tiny_model, "--batch-sizes", "1,2,4", "--prompt-tokens", 8, "--gen-tokens", 4,
                   "--repeat", 2, "--json", "--csv", csv, "--plot", png)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 2, 4]
    assert all(REQUIRED <= set(r) and r["s_tg"] > 0 and r["kv_bytes"] > 0 and r["peak_rss_bytes"] > 0 for r in rows)
    assert rows[0]["speedup"] == 1.0 and rows[2]["efficiency"] == pytest.approx(rows[2]["speedup"] / 4, rel=1e-3)
    assert csv.read_text().splitlines()[0].startswith("batch_size,") and len(csv.read_text().splitlines()) == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_table_lists_every_batch_size(tiny_model):
    result = sweep("-m", tiny_model, "--batch-sizes", "1,3", "--prompt-tokens", 8, "--gen-tokens", 4)
    assert result.exit_code == 0, result.output
    assert "throughput, tokens/s" in result.stdout and "S_TG" in result.stdout and "TTFT p50" in result.stdout


def test_sequential_baseline_runs_llama_cpp_pythons_llama(tiny_model):
    result = sweep("-m", tiny_model, "--batch-sizes", "1,2", "--prompt-tokens", 8, "--gen-tokens", 4,
                   "--baseline", "sequential", "--json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert all(r["sequential_s_tg"] > 0 and r["speedup_vs_sequential"] > 0 for r in rows)


def test_baselines_run_on_the_engines_device_with_its_settings(make_engine, tmp_path, monkeypatch):
    """The catalog's -1 GPU layers reach llama-batched-bench and Llama as they reach the engine
    (they used to get 0: GPU against CPU on a GPU build), and so do its KV layout and batch sizes."""
    monkeypatch.setenv("LLAMABATCH_NATIVE_DIR", str(tmp_path))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-batched-bench").write_text("")  # only its path is read here
    settings = SweepSettings(batch_sizes=(1, 4), prompt_tokens=8, gen_tokens=4)
    engine = make_engine(n_parallel=4, n_ctx=settings.context, n_batch=256)
    config = engine.config
    assert config.gpu_layers == -1  # the catalog's default, untouched by the caller
    command = bench.native_command(engine, settings, 4)
    flags = dict(zip(command[1::2], command[2::2]))
    assert (flags["-ngl"], flags["-b"], flags["-t"]) == ("all", "256", str(config.n_threads))  # the tools' -1 is "auto"
    assert ("-kvu" in command) == config.kv_unified
    llama = bench.sequential_settings(config, settings)
    assert (llama["n_gpu_layers"], llama["n_batch"], llama["n_threads"]) == (-1, 256, config.n_threads)


def test_native_baseline_says_how_to_build_the_tool_when_missing(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMABATCH_NATIVE_DIR", str(tmp_path))
    result = sweep("-m", tiny_model, "--batch-sizes", "1", "--baseline", "native")
    assert result.exit_code == 1 and "scripts/build_native.sh" in result.output


def test_unknown_baseline_and_bad_batch_sizes_are_named(tiny_model):
    assert "unknown baseline" in sweep("-m", tiny_model, "--baseline", "gpu").output
    assert "--batch-sizes must be comma-separated integers" in sweep("-m", tiny_model, "--batch-sizes", "1,x").output
    assert "batch sizes must be >= 1" in sweep("-m", tiny_model, "--batch-sizes", "0,2").output


def _native_built() -> bool:
    try:
        bench.native_tool()
        return True
    except Exception:
        return False


@pytest.mark.real_model  # the tiny model's runs are so short that llama.cpp's log often loses the table
@pytest.mark.skipif(not _native_built(), reason="llama-batched-bench not built (scripts/build_native.sh)")
def test_native_baseline_reads_llama_batched_bench():
    result = sweep("--batch-sizes", "1,2", "--prompt-tokens", 8, "--gen-tokens", 4,
                   "--baseline", "native", "--json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert all(r["native_s_tg"] > 0 and r["s_tg_ratio"] == pytest.approx(r["s_tg"] / r["native_s_tg"], rel=1e-3) for r in rows)
