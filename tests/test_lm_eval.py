"""A real lm-evaluation-harness run (`lm_eval --model local-completions`) against the server, on
local tasks this test writes (no downloads): its accuracy equals the one computed from
BatchEngine.score on the same items, and its generations equal the engine's greedy ones."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

from llamabatch import BatchEngine
from llamabatch.measure.lm_eval import STOP, accuracy, choice_scores, greedy_answers, run_lm_eval

pytest.importorskip("lm_eval")


def run(base: str, folder: Path) -> tuple[dict, Path]:
    """lm_eval's results and its per-sample log, from one run over both tasks against `base`."""
    done = run_lm_eval(base, "tiny", folder, output=folder / "out", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Using remote tokenizer" in done.stderr  # the server's /tokenizer_info and /tokenize, no download
    [results] = glob.glob(str(folder / "out" / "**" / "results_*.json"), recursive=True)
    return json.loads(Path(results).read_text())["results"], folder / "out"


def samples(out: Path, task: str) -> list[dict]:
    [path] = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    return sorted((json.loads(line) for line in Path(path).read_text().splitlines()), key=lambda s: s["doc_id"])


@pytest.mark.fresh_process
def test_lm_eval_agrees_with_score_and_with_the_engines_generations(serve, tiny_model, tmp_path):
    """The server and the reference engine in deterministic mode (so in a process of their own):
    lm-eval groups its requests its own way, and greedy text is only guaranteed equal across
    batch compositions there."""
    results, out = run(serve(n_parallel=4, engine_extra={"deterministic": True}), tmp_path)
    with BatchEngine(tiny_model, n_parallel=4, n_ctx=2048, n_threads=2, deterministic=True) as engine:
        scores = choice_scores(engine)
        # the tiny model's vocabulary ends generations at "</s>" too (lm-eval stops at the EOS text)
        expected = greedy_answers(engine, stop=(*STOP, "</s>"))
    assert results["llamabatch_mc"]["acc,none"] == pytest.approx(accuracy(scores))
    for sample, row in zip(samples(out, "llamabatch_mc"), scores):
        theirs = [float(resp[0][0]) for resp in sample["resps"]]
        assert theirs == pytest.approx([s.logprob for s in row], rel=1e-3)  # JSON's rounding of the floats
    assert any(expected)  # something to compare
    assert [s["resps"][0][0] for s in samples(out, "llamabatch_gen")] == expected
