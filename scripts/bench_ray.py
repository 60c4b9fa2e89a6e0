#!/usr/bin/env python
"""Ray's cost on one machine: `llamabatch batch` on the same prompts, single process against a
local Ray instance with 1 actor (all cores) and 2 actors (the cores split between them).

Each setting runs the real command (`llamabatch batch ... --json`) in a fresh process, rotating
the order each round; the figures are medians over --rounds. "command" is the whole command's
wall time (Ray's start, actor start and model load included), "job" the summary's wall time.

    python scripts/bench_ray.py [--prompts 256] [--max-tokens 32] [--rounds 2] [--model NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUBJECTS = ["rivers", "castles", "engines", "gardens", "winter", "radio", "forests", "markets", "violins", "planets",
            "bridges", "volcanoes", "libraries", "bees", "glaciers", "trains"]

SETTINGS = {
    "single process": [],
    "ray, 1 actor x 2 threads": ["--ray", "local", "--replicas", "1", "--threads", "2"],
    "ray, 2 actors x 1 thread": ["--ray", "local", "--replicas", "2", "--threads", "1"],
}


def run(args: argparse.Namespace, source: Path, extra: list[str], out: Path) -> dict:
    command = [str(Path(sys.executable).parent / "llamabatch"), "batch", str(source), "-o", str(out), "--overwrite",
               "--max-tokens", str(args.max_tokens), "--temperature", "0", "--ignore-eos", "--json", *extra]
    if args.model:
        command += ["-m", args.model]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    summary = json.loads(done.stdout.strip().splitlines()[-1])["summary"]
    return {"command_s": wall, "job_s": summary["wall_s"], "tokens": summary["completion_tokens"], "done": summary["done"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_ray_"))
    source = work / "prompts.txt"
    source.write_text("".join(f"Write a short note about {SUBJECTS[i % len(SUBJECTS)]}, number {i}.\n" for i in range(args.prompts)))
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    names = list(SETTINGS)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            result = run(args, source, SETTINGS[name], work / "out.jsonl")
            assert result["done"] == args.prompts, result
            runs[name].append(result)
            print(f"round {r} {name}: {result}", file=sys.stderr, flush=True)
    single = statistics.median(r["command_s"] for r in runs["single process"])
    print(f"{args.prompts} prompts x {args.max_tokens} tokens, median of {args.rounds} rotating rounds")
    print(f"{'setting':<28}{'command s':>11}{'job s':>9}{'tok/s (command)':>17}{'vs single':>11}")
    for name, results in runs.items():
        command = statistics.median(r["command_s"] for r in results)
        job = statistics.median(r["job_s"] for r in results)
        tokens = results[0]["tokens"]
        print(f"{name:<28}{command:>11.1f}{job:>9.1f}{tokens / command:>17.1f}{single / command:>11.3f}")


if __name__ == "__main__":
    main()
