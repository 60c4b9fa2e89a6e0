"""Sampled decoding against greedy: what sampling as OpenAI clients ask (temperature 0.8, top-p
0.95, no top-k, a seed per request) and with a top-k (40) cost the step, on one model and one run.

Each side decodes the same prompts (EOS ignored, so every sequence does the same work) at the same
--parallel; sides alternate, round after round, and each sampled side's tokens/s is paired with the
greedy run of its round.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from llamabatch import BatchEngine, SamplingParams

from .harness import Spread, alternate, paired, tiny_model

SMOKE = ["--model", "tiny", "--parallel", "4", "--gen-tokens", "8", "--rounds", "1"]
SUBJECTS = ["the sea", "bread", "trains", "owls", "glass", "chess", "rain", "copper", "maps", "tea", "kites", "bees"]
SIDES = {  # name -> the sampling fields of every request
    "greedy": dict(temperature=0),
    "top-p 0.95, no top-k (OpenAI)": dict(temperature=0.8, top_k=0, top_p=0.95, min_p=0),
    "top-k 40, top-p 0.95": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0),
}


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--parallel", type=int, default=32)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)


def run(args, report) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model(Path(tmp))) if args.model == "tiny" else args.model
        with BatchEngine(model, n_parallel=args.parallel, n_ctx=args.parallel * 256, n_threads=args.threads) as engine:
            prompts = [f"Write a few words about {SUBJECTS[i % len(SUBJECTS)]} ({i})." for i in range(args.parallel)]

            def side(fields: dict):
                def measure() -> float:
                    params = [SamplingParams(max_tokens=args.gen_tokens, ignore_eos=True, seed=i, **fields) for i in range(len(prompts))]
                    engine.generate(prompts[:2], params[:2])  # warm
                    started = time.perf_counter()
                    results = engine.generate(prompts, params)
                    if any(r.error for r in results):
                        raise RuntimeError(f"a sequence failed: {[r.error for r in results if r.error][:1]}")
                    return sum(r.completion_tokens for r in results) / (time.perf_counter() - started)
                return measure

            runs = alternate({name: side(fields) for name, fields in SIDES.items()}, args.rounds, label="sampling")
    greedy = runs["greedy"]
    rows = [[name, Spread.of(runs[name]), paired(runs[name], greedy)] for name in SIDES]
    report.figure("tokens_per_s", {name: Spread.of(values) for name, values in runs.items()})
    report.figure("over_greedy", {name: paired(runs[name], greedy) for name in SIDES})
    report.table(f"Sampled against greedy decoding, --parallel {args.parallel}, {args.gen_tokens} tokens a sequence",
                 ["sampling", "tokens/s", "over greedy"], rows,
                 "Every request has its own seed; the prompts' prefill is in the timing, the same for every side.")
