"""A real lm-evaluation-harness run (`lm_eval --model local-completions`) against the server, on
local tasks this test writes (no downloads): its accuracy equals the one computed from
BatchEngine.score on the same items, and its generations equal the engine's greedy ones."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llamabatch import BatchEngine, SamplingParams

pytest.importorskip("lm_eval")

ITEMS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Berlin", "Madrid"], "answer": 0},
    {"question": "Two plus two is", "choices": ["three", "four", "five"], "answer": 1},
    {"question": "The opposite of hot is", "choices": ["cold", "warm", "loud"], "answer": 0},
    {"question": "A baby cat is called a", "choices": ["puppy", "kitten", "calf"], "answer": 1},
    {"question": "Once upon a", "choices": ["time", "hello", "world"], "answer": 0},
    {"question": "the capital of", "choices": ["France", "the", "a"], "answer": 0},
]

TASKS = {
    "mc.yaml": """task: llamabatch_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""",
    "gen.yaml": """task: llamabatch_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}


def run_lm_eval(base: str, folder: Path) -> tuple[dict, Path]:
    """lm_eval's results and its per-sample log, from one run over both tasks against `base`."""
    items = folder / "items.jsonl"
    items.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    for name, text in TASKS.items():
        (folder / name).write_text(text.format(items=items))
    done = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions",
         "--model_args", f"model=tiny,base_url={base}/v1/completions,num_concurrent=1,max_retries=1",
         "--tasks", "llamabatch_mc,llamabatch_gen", "--include_path", str(folder), "--batch_size", "4",
         "--output_path", str(folder / "out"), "--log_samples"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
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
    results, out = run_lm_eval(serve(n_parallel=4, engine_extra={"deterministic": True}), tmp_path)
    with BatchEngine(tiny_model, n_parallel=4, n_ctx=2048, n_threads=2, deterministic=True) as engine:
        # lm-eval's API models send token ids without BOS, and put a space before each choice
        scores = [engine.score([(item["question"], " " + c) for c in item["choices"]], bos=False) for item in ITEMS]
        prompts = [engine.vocab.tokenize(item["question"], add_special=False) for item in ITEMS]
        expected = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, stop=("\n", "</s>")))
    picked = [int(np.argmax([s.logprob for s in row])) for row in scores]
    accuracy = sum(p == item["answer"] for p, item in zip(picked, ITEMS)) / len(ITEMS)
    assert results["llamabatch_mc"]["acc,none"] == pytest.approx(accuracy)
    for sample, row in zip(samples(out, "llamabatch_mc"), scores):
        theirs = [float(resp[0][0]) for resp in sample["resps"]]
        assert theirs == pytest.approx([s.logprob for s in row], rel=1e-3)  # JSON's rounding of the floats
    assert any(r.text for r in expected)  # something to compare
    assert [s["resps"][0][0] for s in samples(out, "llamabatch_gen")] == [r.text for r in expected]
