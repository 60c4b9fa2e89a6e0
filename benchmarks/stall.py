"""Streams while a long prompt is read: the gaps of generating streams, and the prompt's first token.

One server with --slots slots, -c --ctx and --threads threads: --streams streamed completions
generate (greedy, EOS ignored); once each has --warm tokens, one prompt of about --prompt-tokens
tokens arrives (its own words: no prefix to reuse). Measured on each stream's tokens as the
client receives them: the median gap before the long prompt arrived, the worst and p99 gap while
it was read (from its arrival to its first token), the long prompt's time to first token, and
the streams' tokens/s over the run. Sides alternate, a fresh server each: `llamabatch serve` at
each --step-target of --sides (`llamabatch:auto`, `llamabatch:200ms`; `llamabatch:off` reads
whole --batch-size chunks, as before the budget), and llama.cpp's llama-server
(scripts/build_native.sh) with -np and -kvu.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from .harness import Spread, alternate, model_path, paired, tiny_model
from .servers import llama_server, llamabatch_serve

SMOKE = ["--model", "tiny", "--rounds", "1", "--streams", "2", "--slots", "3", "--ctx", "8192", "--prompt-tokens", "300",
         "--stream-tokens", "2000", "--warm", "4", "--sides", "llamabatch:auto,llamabatch:off"]
SIDES = ("llamabatch:auto", "llamabatch:200ms", "llamabatch:off", "llama-server")
WORDS = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "granite", "harbor", "indigo", "juniper", "kestrel", "lagoon",
         "meadow", "nickel", "orchid", "pewter", "quartz", "russet", "sierra", "tundra", "umber", "violet", "willow", "zephyr")


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path (default: the default model); 'tiny' for the tests' model")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=7)
    parser.add_argument("--stream-tokens", type=int, default=400, help="each stream's max_tokens: it must outlast the prompt's reading")
    parser.add_argument("--warm", type=int, default=20, help="tokens each stream has before the long prompt is sent")
    parser.add_argument("--prompt-tokens", type=int, default=3000, help="about this many: words of their own")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"of {', '.join(SIDES)}")
    parser.add_argument("--rounds", type=int, default=3)


def long_prompt(tokens: int) -> str:
    """About `tokens` tokens of words no stream's prompt begins with (Gemma 3 reads a word and its number as three)."""
    rng = np.random.default_rng(7)
    n = tokens // 3
    return "Notes: " + " ".join(f"{WORDS[i]}{j}" for i, j in zip(rng.integers(0, len(WORDS), n), rng.integers(0, 100, n)))


class Stream(threading.Thread):
    """A streamed completion: the time each token's chunk arrived."""

    def __init__(self, base: str, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base, self.prompt, self.max_tokens = base, prompt, max_tokens
        self.sent: float | None = None
        self.times: list[float] = []
        self.error: str | None = None

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        self.sent = time.perf_counter()
        try:
            with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=600) as response:
                if response.status_code != 200:
                    self.error = f"HTTP {response.status_code}"
                    return
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                        self.times.append(time.perf_counter())
        except httpx.HTTPError as e:
            self.error = type(e).__name__


def experiment(base: str, args) -> dict:
    streams = [Stream(base, f"Story {i}: once upon a time, in a town by the sea,", args.stream_tokens) for i in range(args.streams)]
    for stream in streams:
        stream.start()
    while any(len(s.times) < args.warm for s in streams) and all(s.is_alive() for s in streams):
        time.sleep(0.01)
    reader = Stream(base, long_prompt(args.prompt_tokens), 4)
    reader.start()
    reader.join()
    for stream in streams:
        stream.join()
    failed = [s.error for s in [*streams, reader] if s.error or not s.times]
    if failed:
        raise RuntimeError(f"requests failed at {base}: {failed}")
    arrived, first = reader.sent, reader.times[0]
    before = [b - a for s in streams for a, b in zip(s.times, s.times[1:]) if b <= arrived]
    during = [b - a for s in streams for a, b in zip(s.times, s.times[1:]) if b > arrived and a < first]
    if not before or not during:
        raise RuntimeError(f"the streams did not run on while the prompt was read at {base}: raise --stream-tokens or --warm")
    start, end = min(s.times[0] for s in streams), max(s.times[-1] for s in streams)
    return {
        "median_gap_before_s": statistics.median(before), "worst_gap_s": max(during), "p99_gap_s": float(np.percentile(during, 99)),
        "ttft_s": first - arrived, "stream_tokens_per_s": sum(len(s.times) for s in streams) / (end - start),
    }


def run(args, report) -> None:
    sides = args.sides.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        gguf = tiny_model(Path(tmp)) if args.model == "tiny" else model_path(args.model)
        def server(side: str):
            if side == "llama-server":
                return llama_server(gguf, "-np", args.slots, "-c", args.ctx, "-t", args.threads, "-kvu")
            target = side.removeprefix("llamabatch:")
            return llamabatch_serve(gguf, "--parallel", args.slots, "--ctx", args.ctx, "-t", args.threads, "--step-target", target)

        def measure(side: str):
            def once() -> dict:
                with server(side) as running:
                    return experiment(running.base, args)
            return once

        runs = alternate({side: measure(side) for side in sides}, args.rounds, label="stall")
    rows = []
    for side, results in runs.items():
        median_gap = [r["median_gap_before_s"] for r in results]
        worst = [r["worst_gap_s"] for r in results]
        rows.append([side, Spread.of([g * 1e3 for g in median_gap]), Spread.of([w * 1e3 for w in worst]),
                     Spread.of([r["p99_gap_s"] * 1e3 for r in results]), paired(worst, median_gap),
                     Spread.of([r["ttft_s"] for r in results]), Spread.of([r["stream_tokens_per_s"] for r in results])])
        report.figure(f"{_key(side)}_worst_over_median_gap", paired(worst, median_gap))
        report.figure(f"{_key(side)}_ttft_s", Spread.of([r["ttft_s"] for r in results]))
    for a in [side for side in sides if side.startswith("llamabatch:") and side != "llamabatch:off"]:
        for b in ("llamabatch:off", "llama-server"):
            if b not in runs:
                continue
            key = f"{_key(a)}_vs_{_key(b)}"
            ttft = paired([r["ttft_s"] for r in runs[a]], [r["ttft_s"] for r in runs[b]])
            speed = paired([r["stream_tokens_per_s"] for r in runs[a]], [r["stream_tokens_per_s"] for r in runs[b]])
            report.figure(f"{key}_ttft", ttft)
            report.figure(f"{key}_stream_tokens_per_s", speed)
            rows.append([f"{a} / {b}", "", "", "", "", ttft, speed])
    report.table(
        f"{Path(gguf).name}: {args.streams} streams generating, then a ~{args.prompt_tokens}-token prompt; {args.slots} slots, "
        f"-c {args.ctx}, {args.threads} threads; llamabatch:TARGET is serve --step-target TARGET",
        ["side", "median gap before (ms)", "worst gap while read (ms)", "p99 gap while read (ms)", "worst / median",
         "long prompt's TTFT (s)", "streams' tokens/s"], rows,
        f"Medians (lowest–highest) of {args.rounds} alternating rounds, a fresh server each; a ratio row is paired within rounds.",
    )


def _key(side: str) -> str:
    return side.replace(":", "_").replace("-", "_")
