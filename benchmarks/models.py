"""Several models behind one server: what switching between them costs, and what a model's first request waits for.

One `llamabatch serve --model A --model B` (two copies of one GGUF under two names, so both
sides decode the same arithmetic) answers, in each round:
  one model    --requests sequential greedy requests, all to A;
  alternating  the same requests, to A and B in turn (both loaded);
  first        B unloaded (POST /models/unload), then one request to B: it waits for B's load.
Figures: the mean request time alternating over one model (1.0: switching costs nothing), and the
first request's time over B's own load time (from /v1/models) plus a loaded request's time.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import httpx

from .harness import Spread, model_path, paired, progress, tiny_model
from .servers import llamabatch_serve

SMOKE = ["--model", "tiny", "--requests", "4", "--rounds", "1", "--tokens", "8"]


def request(base: str, model: str, tokens: int) -> float:
    started = time.perf_counter()
    reply = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "The history of the harbour, in short:",
                                                       "max_tokens": tokens, "temperature": 0, "ignore_eos": True}, timeout=600)
    if reply.status_code != 200:
        raise RuntimeError(f"{model}: {reply.status_code} {reply.text[:200]}")
    return time.perf_counter() - started


def card(base: str, model: str) -> dict:
    return next(c for c in httpx.get(f"{base}/v1/models").json()["data"] if c["id"] == model)


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())


def run(args, report) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        source = tiny_model(Path(tmp)) if args.model == "tiny" else model_path(args.model)
        names = ["model-a", "model-b"]
        for name in names:
            os.symlink(source, Path(tmp) / f"{name}.gguf")
        paths = [str(Path(tmp) / f"{name}.gguf") for name in names]
        one, alternating, first, load, loaded = [], [], [], [], []
        with llamabatch_serve(paths[0], "-m", paths[1], "--parallel", "4", "--threads", args.threads) as server:
            base = server.base
            for name in names:  # both loaded, and warm
                request(base, name, args.tokens)
            for r in range(args.rounds):
                progress(f"round {r + 1} of {args.rounds}")
                one.append(sum(request(base, names[0], args.tokens) for _ in range(args.requests)) / args.requests)
                alternating.append(sum(request(base, names[k % 2], args.tokens) for k in range(args.requests)) / args.requests)
                loaded.append(request(base, names[1], args.tokens))
                httpx.post(f"{base}/models/unload", json={"model": names[1]}, timeout=60).raise_for_status()
                first.append(request(base, names[1], args.tokens))
                load.append(card(base, names[1])["status"]["load_s"])
    switch = paired(alternating, one)
    waits = paired(first, [l + w for l, w in zip(load, loaded)])
    report.figure("alternating_over_one_model", switch)
    report.figure("first_request_over_load_plus_request", waits)
    report.table(
        "Two models behind one server: mean request time (s)",
        ["requests", "time (s)", "ratio, same round"],
        [["all to one model", Spread.of(one), ""],
         ["alternating between two loaded models", Spread.of(alternating), switch],
         ["a loaded model's request", Spread.of(loaded), ""],
         ["its load (from /v1/models)", Spread.of(load), ""],
         ["the first request to an unloaded model", Spread.of(first), waits]],
        f"Medians (lowest–highest) of {args.rounds} rounds of {args.requests} sequential greedy requests of {args.tokens} tokens; "
        "the first request's ratio is over its model's load plus a loaded request.",
    )
