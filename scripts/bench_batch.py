#!/usr/bin/env python
"""What a batch job costs: peak memory against the number of prompts, and `batch` against `run`.

memory      `llamabatch batch` on the tests' tiny model over N short prompts (--max-tokens 1),
            for each N; peak RSS of each process (os.wait4). Memory must not grow with N.
throughput  the same prompts (varied encyclopedia requests, greedy, --max-tokens 32) through
            `llamabatch run --prompts-file` and `llamabatch batch`, in alternating processes,
            on the default model. Prints each side's median generated tokens/s (process wall
            time, model load included, and each command's own figure) and the median ratio.

    python scripts/bench_batch.py memory --sizes 10000,100000
    python scripts/bench_batch.py throughput --prompts 256 --pairs 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_model import write_tiny_model  # noqa: E402

WORDS = "the a of is and to in capital France Paris def fib once upon time hello world".split()
SUBJECTS = ["the moon", "bread", "rivers", "chess", "volcanoes", "the violin", "honey bees", "glass", "maps", "tea",
            "bicycles", "snow", "lighthouses", "paper", "owls", "copper", "gardens", "trains", "clocks", "salt"]
FORMS = ["Tell me about {}.", "Write a short poem about {}.", "Explain {} to a child.", "Three facts about {}:",
         "A story that begins with {}", "Why do people love {}?"]
CLI = [sys.executable, "-m", "llamabatch.cli"]


def timed(command: list[str]) -> tuple[float, int, str]:
    """Run a command; its wall seconds, peak RSS (KiB) and stdout."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"failed: {' '.join(command)}")
        out.seek(0)
        return wall, usage.ru_maxrss, out.read()


def memory(args: argparse.Namespace, work: Path) -> None:
    model = write_tiny_model(work / "tiny.gguf")
    rng = random.Random(0)
    print(f"{'prompts':>9}  {'peak RSS':>10}  {'wall':>7}  {'requests/s':>10}")
    for n in map(int, args.sizes.split(",")):
        source = work / f"prompts-{n}.txt"
        source.write_text("".join(" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) + "\n" for _ in range(n)))
        wall, rss, _ = timed([*CLI, "batch", str(source), "-o", str(work / f"out-{n}.jsonl"), "-m", str(model),
                              "--max-tokens", "1", "--parallel", "32", "--ctx", "8192", "--json"])
        print(f"{n:>9,}  {rss / 1024:>7.1f} MiB  {wall:>6.1f}s  {n / wall:>10,.0f}")


def throughput(args: argparse.Namespace, work: Path) -> None:
    prompts = [FORMS[i % len(FORMS)].format(SUBJECTS[i // len(FORMS) % len(SUBJECTS)]) + f" ({i})" for i in range(args.prompts)]
    source = work / "prompts.txt"
    source.write_text("\n".join(prompts) + "\n")
    common = ["--max-tokens", str(args.max_tokens), "--temperature", "0", "--parallel", str(args.parallel)]
    sides = {
        "run": lambda i: [*CLI, "run", "--prompts-file", str(source), "--json", *common],
        "batch": lambda i: [*CLI, "batch", str(source), "-o", str(work / f"out-{i}.jsonl"), "--json", *common],
    }
    results: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for i in range(args.pairs):
        for side in (("run", "batch") if i % 2 == 0 else ("batch", "run")):
            wall, _, stdout = timed(sides[side](i))
            summary = json.loads(stdout.splitlines()[-1])["summary"]
            results[side].append((summary["completion_tokens"] / wall, summary["tokens_per_s"]))
            print(f"pair {i + 1} {side:>5}: {summary['completion_tokens']} tokens, {wall:.1f} s process, "
                  f"{results[side][-1][0]:.1f} tok/s process, {summary['tokens_per_s']:.1f} tok/s own", file=sys.stderr)
    print(f"{args.prompts} prompts, --max-tokens {args.max_tokens}, --parallel {args.parallel}, {args.pairs} pairs")
    for k, label in enumerate(("process wall (load included)", "command's own summary")):
        run = statistics.median(r[k] for r in results["run"])
        batch = statistics.median(r[k] for r in results["batch"])
        ratios = statistics.median(b[k] / r[k] for r, b in zip(results["run"], results["batch"]))
        print(f"{label:>30}: run {run:.1f} tok/s, batch {batch:.1f} tok/s, batch/run median of pairs {ratios:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    m = sub.add_parser("memory")
    m.add_argument("--sizes", default="10000,100000")
    t = sub.add_parser("throughput")
    t.add_argument("--prompts", type=int, default=256)
    t.add_argument("--max-tokens", type=int, default=32)
    t.add_argument("--parallel", type=int, default=32)
    t.add_argument("--pairs", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (memory if args.what == "memory" else throughput)(args, Path(tmp))


if __name__ == "__main__":
    main()
