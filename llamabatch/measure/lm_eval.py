"""A small lm-evaluation-harness task pair over local items (no downloads), run against a
llamabatch server with `lm_eval --model local-completions`: multiple choice scored by
log-likelihood, and greedy generate_until. The tests check its figures against BatchEngine.score
and generate; `python -m benchmarks lm_eval` runs it on a real model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from ..engine import BatchEngine, SamplingParams
from ..engine.results import Score

# (question, choices, index of the right choice)
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
TASKS = ("llamabatch_mc", "llamabatch_gen")
GEN_TOKENS = 16  # generate_until's max_gen_toks
STOP = ("\n",)  # and its `until`

_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
doc_to_text: "{{{{question}}}}"
{rest}"""
_MULTIPLE_CHOICE = """output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
"""
_GENERATE = f"""output_type: generate_until
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: {json.dumps(list(STOP))}
  max_gen_toks: {GEN_TOKENS}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(folder: Path, items: list = ITEMS) -> None:
    """The items as JSON Lines and the two task files, in `folder` (lm_eval's --include_path)."""
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in items))
    for name, rest in zip(TASKS, (_MULTIPLE_CHOICE, _GENERATE)):
        (folder / f"{name}.yaml").write_text(_TASK.format(name=name, items=data, rest=rest))


def run_lm_eval(base_url: str, model: str, folder: Path, items: list = ITEMS, *, output: Path | None = None,
                timeout: float = 1800) -> subprocess.CompletedProcess:
    """lm_eval over both tasks against the server at base_url (requests name `model`), offline;
    with `output`, its results and per-sample logs are written there."""
    write_tasks(folder, items)
    command = [
        sys.executable, "-m", "lm_eval", "--model", "local-completions",
        "--model_args", f"model={model},base_url={base_url}/v1/completions,num_concurrent=1,max_retries=1",
        "--tasks", ",".join(TASKS), "--include_path", str(folder), "--batch_size", "4",
    ]
    if output is not None:
        command += ["--output_path", str(output), "--log_samples"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def choice_scores(engine: BatchEngine, items: list = ITEMS) -> list[list[Score]]:
    """Each choice's score given its question, as lm-eval's API models ask for it: token ids
    without BOS, a space before the choice."""
    return [engine.score([(question, " " + c) for c in choices], bos=False) for question, choices, _ in items]


def accuracy(scores: list[list[Score]], items: list = ITEMS) -> float:
    picked = [int(np.argmax([s.logprob for s in row])) for row in scores]
    return sum(p == answer for p, (_, _, answer) in zip(picked, items)) / len(items)


def greedy_answers(engine: BatchEngine, items: list = ITEMS, stop: tuple[str, ...] = STOP) -> list[str]:
    """What generate_until should get back: each question's greedy continuation, no BOS, cut at `stop`."""
    prompts = [engine.vocab.tokenize(question, add_special=False) for question, _, _ in items]
    params = SamplingParams(temperature=0, max_tokens=GEN_TOKENS, stop=stop)
    return [r.text for r in engine.generate(prompts, params)]
