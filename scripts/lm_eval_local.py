#!/usr/bin/env python
"""Run lm-evaluation-harness against `llamabatch serve`, offline, and check it against `score`.

Installs lm-eval[api] if it is missing, starts the server on a free port, writes two local tasks
(multiple choice, scored by log-likelihood; and generate_until) over a small JSON file of
questions, runs `lm_eval --model local-completions`, and prints its table beside the accuracy
`llamabatch score` computes on the same items (no BOS, a space before each choice: what
lm-eval's API models send).

    python scripts/lm_eval_local.py [--model NAME|PATH] [--parallel 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ITEMS = [
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("Two plus two is", ["three", "four", "five"], 1),
    ("The opposite of hot is", ["cold", "warm", "loud"], 0),
    ("A baby cat is called a", ["puppy", "kitten", "calf"], 1),
    ("The sky on a clear day is", ["green", "blue", "red"], 1),
    ("Water freezes at zero degrees", ["Celsius", "Kelvin", "Rankine"], 0),
    ("The largest planet in our solar system is", ["Mercury", "Jupiter", "Mars"], 1),
    ("Bees make", ["honey", "milk", "silk"], 0),
    ("The first month of the year is", ["March", "January", "June"], 1),
    ("A triangle has three", ["sides", "wheels", "moons"], 0),
    ("The chemical symbol for gold is", ["Ag", "Au", "Fe"], 1),
    ("Shakespeare wrote", ["Hamlet", "Dracula", "Frankenstein"], 0),
]

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
doc_to_text: "{{{{question}}}}"
{rest}"""
MULTIPLE_CHOICE = """output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
"""
GENERATE = """output_type: generate_until
doc_to_target: "{{choices[answer]}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def ensure_lm_eval() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        print("installing lm-eval[api]==0.4.13 ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "lm-eval[api]==0.4.13"], check=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def score_accuracy(model: str | None) -> float:
    from llamabatch import BatchEngine

    with BatchEngine(model, n_parallel=4) as engine:
        right = 0
        for question, choices, answer in ITEMS:
            scores = engine.score([(question, " " + c) for c in choices], bos=False)
            right += int(np.argmax([s.logprob for s in scores])) == answer
    return right / len(ITEMS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--parallel", type=int, default=4)
    args = parser.parse_args()
    ensure_lm_eval()
    port = free_port()
    serve = [sys.executable, "-m", "llamabatch.cli", "serve", "--port", str(port), "--parallel", str(args.parallel)]
    server = subprocess.Popen(serve + (["--model", args.model] if args.model else []))
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        served = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]  # requests must name the model served
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            items = folder / "items.jsonl"
            items.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in ITEMS))
            for name, rest in (("llamabatch_mc", MULTIPLE_CHOICE), ("llamabatch_gen", GENERATE)):
                (folder / f"{name}.yaml").write_text(TASK.format(name=name, items=items, rest=rest))
            subprocess.run(
                [sys.executable, "-m", "lm_eval", "--model", "local-completions",
                 "--model_args", f"model={served},base_url={base}/v1/completions,num_concurrent=1,max_retries=1",
                 "--tasks", "llamabatch_mc,llamabatch_gen", "--include_path", str(folder), "--batch_size", "4"],
                check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
            )
    finally:
        server.terminate()
        server.wait()
    print(f"llamabatch score on the same items: acc {score_accuracy(args.model):.4f}")


if __name__ == "__main__":
    main()
