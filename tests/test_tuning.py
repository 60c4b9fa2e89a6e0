"""The batch size by measurement: `llamabatch tune`, `--parallel auto` taking its result, and a
batch job's estimate. On the tiny model; the measurements go to the suite's own folder
(conftest's LLAMABATCH_TUNE_DIR)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llamabatch.cli import app
from llamabatch.engine.sizing import tuning
from llamabatch.engine.sizing.options import EngineOptions
from llamabatch.engine.sizing.tuning import MIN_GAIN, TunePoint, Tuning
from llamabatch.jobs.estimate import expected_seconds


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def curve(*points: tuple[int, float, float]) -> Tuning:
    """A tuning of (batch size, decode tokens/s, p95 inter-token seconds) points."""
    return Tuning("k", {}, 32, tuple(TunePoint(b, s_tg, 1000.0 * b, p95 / 2, p95) for b, s_tg, p95 in points), 1.0)


def test_the_choice_is_the_fastest_size_within_the_latency_budget():
    measured = curve((1, 100, 0.010), (2, 180, 0.011), (4, 300, 0.013), (8, 420, 0.019), (16, 430, 0.037))
    assert measured.choose().batch_size == 16  # no budget: the highest throughput
    assert measured.choose(0.020).batch_size == 8
    assert measured.choose(0.012).batch_size == 2
    assert measured.choose(0.001).batch_size == 1  # nothing within it: the lowest latency there is


def test_for_a_job_the_choice_counts_its_prefill():
    """Long prompts weigh the prefill rate: a size fast at decoding but slow at prefill loses."""
    slow_prefill = Tuning("k", {}, 32, (TunePoint(8, 400, 5000, 0.02, 0.02), TunePoint(16, 420, 1000, 0.04, 0.04)), 1.0)
    assert slow_prefill.choose().batch_size == 16  # decode throughput alone
    assert slow_prefill.choose(job=(1000, 16)).batch_size == 8  # 0.24 s a request against 1.04
    assert slow_prefill.choose(job=(10, 1000)).batch_size == 16


def test_tune_takes_a_job_files_prompts(tiny_model, tmp_path):
    job = tmp_path / "job.jsonl"
    job.write_text("".join(json.dumps({"prompt": "word " * 20, "max_tokens": 7}) + "\n" for _ in range(5)))
    done = invoke("tune", "-m", tiny_model, "--threads", 2, "--max-batch", 4, "--job", job, "--again", "--json")
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout.splitlines()[-1])
    # its progress, a plain line per size measured (the ladder 1, 2, 4)
    progress = [line for line in done.stderr.splitlines() if line.startswith("measuring batch sizes: ")]
    sizes = [p["batch_size"] for p in result["points"]]
    assert [line.split(" · ")[0] for line in progress] == [f"measuring batch sizes: {i}/3" for i in range(1, len(sizes) + 1)]
    assert all(f"B={b}: " in line for b, line in zip(sizes, progress))
    from llamabatch import BatchEngine

    with BatchEngine(tiny_model, n_parallel=1, n_ctx=256, n_threads=2) as engine:
        length = len(engine.tokenize_prompt("word " * 20))
    assert result["job"] == [length, 7] and result["prompt_tokens"] == length


def test_a_search_stops_once_a_larger_batch_no_longer_pays(tiny_model):
    """On the real engine: every size before the last raised the best throughput by MIN_GAIN; the
    last is the ladder's end or one that did not (measured twice before stopping on it)."""
    options = EngineOptions(model=tiny_model, threads=2)
    measured = options.tuning(64, again=True)
    sizes = [p.batch_size for p in measured.points]
    assert sizes == tuning.ladder(64)[: len(sizes)]
    for i, point in enumerate(measured.points[1:-1], 1):
        assert point.s_tg >= MIN_GAIN * max(p.s_tg for p in measured.points[:i])
    last = measured.points[-1]
    assert last.batch_size == 64 or last.s_tg < MIN_GAIN * max(p.s_tg for p in measured.points[:-1])
    assert all(p.itl_p50_s <= p.itl_p95_s and p.s_pp > 0 for p in measured.points)


def test_a_batch_whose_prompts_take_longer_to_read_than_the_measured_steps_is_still_measured(tiny_model):
    """256 prompts of 32 tokens through n_batch 512: the prompts take about 22 steps to read,
    while the first sequences generate beside them; they go on (and are cancelled once
    measured) rather than end before the last starts, which left no decode step to time."""
    from llamabatch import BatchEngine

    with BatchEngine(tiny_model, n_parallel=256, n_ctx=256 * tuning.cells_per_sequence(32), n_batch=512, n_threads=2) as engine:
        point = tuning.measure(engine, 256)
        assert not engine.has_work  # nothing left running
    assert point.batch_size == 256 and point.s_tg > 0 and point.itl_p50_s <= point.itl_p95_s


def test_a_measurement_is_stored_reused_and_kept_apart_by_the_settings_that_change_it(tiny_model):
    options = EngineOptions(model=tiny_model, threads=2)
    first = options.tuning(8)
    said = []
    again = options.tuning(8, say=said.append)
    assert again == first and said == []  # read back, not measured again
    assert (tuning.store_dir() / f"{first.key}.json").is_file()
    other = EngineOptions(model=tiny_model, threads=1)
    assert other.stored_tuning() is None or other.stored_tuning().key != first.key
    fresh = other.tuning(4, say=said.append)
    assert fresh.key != first.key and said and "measuring it" in said[0]
    assert EngineOptions(model=tiny_model, threads=2, cache_type_k="q8_0").stored_tuning() is None


def test_tune_shows_the_curve_and_honours_the_budget(tiny_model, tmp_path):
    done = invoke("tune", "-m", tiny_model, "--threads", 2, "--max-batch", 16, "--json")
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout.splitlines()[-1])
    fastest = max(result["points"], key=lambda p: p["s_tg"])
    assert result["chosen"] == fastest["batch_size"]
    budget = min(p["itl_p95_s"] for p in result["points"]) * 1.0001
    within = invoke("tune", "-m", tiny_model, "--threads", 2, "--max-batch", 16, "--max-itl", f"{budget * 1000}ms", "--json")
    chosen = json.loads(within.stdout.splitlines()[-1])
    point = next(p for p in chosen["points"] if p["batch_size"] == chosen["chosen"])
    assert point["itl_p95_s"] <= budget and chosen["within_max_itl"]
    # A budget nothing meets: the lowest latency is taken, and said to be over the budget, not within it
    over = invoke("tune", "-m", tiny_model, "--threads", 2, "--max-batch", 16, "--max-itl", "0.000001ms")
    assert over.exit_code == 0, over.output
    assert "no batch size keeps p95 within" in " ".join(over.output.split()) and "the lowest latency measured" in " ".join(over.output.split())
    assert "within p95" not in " ".join(over.output.split())
    pytest.importorskip("matplotlib")
    plotted = invoke("tune", "-m", tiny_model, "--threads", 2, "--max-batch", 16, "--plot", tmp_path / "tune.png")
    assert plotted.exit_code == 0 and (tmp_path / "tune.png").stat().st_size > 1000
    assert "chosen" in plotted.output and "batch size" in plotted.output


def test_auto_resolves_alike_on_every_command(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(40)))
    expected = min(EngineOptions(model=tiny_model, threads=2).tuning(256).choose().batch_size, 40)
    run = invoke("run", "-m", tiny_model, "--threads", 2, "--prompts-file", prompts, "--max-tokens", 2, "--parallel", "auto", "--json")
    batch = invoke("batch", prompts, "-o", tmp_path / "out.jsonl", "-m", tiny_model, "--threads", 2, "--max-tokens", 2,
                   "--parallel", "auto", "--json")
    assert run.exit_code == 0 and batch.exit_code == 0, run.output + batch.output
    assert json.loads(run.stdout.splitlines()[-1])["summary"]["parallel"] == expected
    assert json.loads(batch.stdout.splitlines()[-1])["summary"]["parallel"] == expected
    refused = invoke("serve", "-m", tiny_model, "--max-itl", "150ms")
    assert refused.exit_code == 1 and "--max-itl is the latency --parallel auto chooses for" in refused.output
    bad = invoke("serve", "-m", tiny_model, "--parallel", "auto", "--max-itl", "soon")
    assert bad.exit_code == 1 and "--max-itl: not a duration: 'soon'" in bad.output


def test_the_estimate_adds_prefill_and_decode_at_the_measured_rates():
    measured = curve((1, 100, 0.01), (4, 300, 0.013), (16, 800, 0.02))
    # 8 slots: the 4-sequence rate (the nearest measured size not above); prefill at its 4000 tok/s
    assert expected_seconds(measured, 8, 4000, 3000) == pytest.approx(4000 / 4000 + 3000 / 300)
    assert expected_seconds(measured, 16, 16000, 8000) == pytest.approx(1 + 10)
    assert expected_seconds(None, 8, 1, 1) is None


def test_batch_estimate_counts_the_job_and_runs_nothing(tiny_model, tmp_path):
    from llamabatch import BatchEngine

    prompts = tmp_path / "prompts.txt"
    texts = [f"Tell me about item {i}" for i in range(30)]
    prompts.write_text("\n".join(texts) + "\nnot json but fine as text\n")
    out = tmp_path / "out.jsonl"
    done = invoke("batch", prompts, "-o", out, "-m", tiny_model, "--threads", 2, "--parallel", 4, "--max-tokens", 10,
                  "--estimate", "--json")
    assert done.exit_code == 0, done.output
    guess = json.loads(done.stdout.splitlines()[-1])["estimate"]
    with BatchEngine(tiny_model, n_parallel=1, n_ctx=256, n_threads=2) as engine:
        tokens = sum(len(engine.tokenize_prompt(t)) for t in [*texts, "not json but fine as text"])
    assert guess["requests"] == 31 and guess["prompt_tokens"] == tokens and guess["max_new_tokens"] == 31 * 10
    assert guess["parallel"] == 4 and guess["seconds"] > 0
    assert not out.exists()  # nothing ran
    ran = invoke("batch", prompts, "-o", out, "-m", tiny_model, "--threads", 2, "--parallel", 4, "--max-tokens", 10, "--json")
    summary = json.loads(ran.stdout.splitlines()[-1])["summary"]
    assert summary["estimated_s"] == pytest.approx(guess["seconds"], abs=0.001)  # the summary shows it beside the wall time
    assert "expected time" in ran.stderr
