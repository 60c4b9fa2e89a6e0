"""lm-evaluation-harness against `llamabatch serve`, offline, checked against `llamabatch score`.

Starts the server, writes two local tasks (multiple choice scored by log-likelihood, and greedy
generate_until; llamabatch.measure.lm_eval, the same tasks the tests run) and runs
`lm_eval --model local-completions`; then computes the multiple-choice accuracy from
BatchEngine.score on the same items (no BOS, a space before each choice: what lm-eval's API
models send). The two accuracies must be equal.
"""

from __future__ import annotations

import glob
import json
import tempfile
from pathlib import Path

import httpx

from llamabatch import BatchEngine
from llamabatch.measure.lm_eval import ITEMS, accuracy, choice_scores, run_lm_eval

from .harness import tiny_model
from .servers import llamabatch_serve

SMOKE = ["--model", "tiny", "--items", "3"]


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--items", type=int, default=len(ITEMS))


def run(args, report) -> None:
    items = ITEMS[: args.items]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = str(tiny_model(folder)) if args.model == "tiny" else args.model
        with llamabatch_serve(*([model] if model else ["gemma3-270m"]), "--parallel", args.parallel) as server:
            served = httpx.get(f"{server.base}/v1/models").json()["data"][0]["id"]  # requests must name the model served
            done = run_lm_eval(server.base, served, folder, items, output=folder / "out")
        if done.returncode != 0:
            raise RuntimeError(f"lm_eval failed: {done.stderr[-2000:]}")
        [path] = glob.glob(str(folder / "out" / "**" / "results_*.json"), recursive=True)
        results = json.loads(Path(path).read_text())["results"]
        with BatchEngine(model, n_parallel=args.parallel) as engine:
            ours = accuracy(choice_scores(engine, items), items)
    theirs = results["llamabatch_mc"]["acc,none"]
    report.figure("lm_eval_acc", theirs)
    report.figure("score_acc", ours)
    report.table(f"{len(items)} items, {served}", ["measure", "lm_eval (through the server)", "llamabatch score"],
                 [["multiple choice accuracy", theirs, ours],
                  ["generate_until exact match", results["llamabatch_gen"]["exact_match,none"], ""]],
                 "The accuracies agree." if abs(theirs - ours) < 1e-9 else "THE ACCURACIES DIFFER.")
    if abs(theirs - ours) >= 1e-9:
        raise RuntimeError(f"lm_eval's accuracy {theirs} differs from score's {ours}")
