#!/usr/bin/env python
"""llamabatch's own cost per step: `llamabatch sweep --baseline native` on a model whose decode is
fast (the tests' tiny model by default), so what is not llama_decode shows.

Each round runs one sweep process per source tree (this one, and --before DIR, another
checkout, if given), alternating which goes first; each sweep runs llama-batched-bench beside
its own measurements. Prints the median S_TG of every tree and of native llama.cpp per batch
size, and each tree's median ratio to native.

    python scripts/bench_step_overhead.py --rounds 5
    git worktree add /tmp/before HEAD~3 && python scripts/bench_step_overhead.py --before /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from tiny_model import write_tiny_model  # noqa: E402


def sweep(tree: Path, model: str, args: argparse.Namespace) -> dict[int, dict]:
    command = [sys.executable, "-m", "llamabatch.cli", "sweep", "--model", model, "--batch-sizes", args.batch_sizes,
               "--baseline", "native", "--json", "--threads", str(args.threads), "--gen-tokens", str(args.gen_tokens)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env, cwd=tree).stdout
    return {p["batch_size"]: p for p in map(json.loads, out.splitlines())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF path or catalog name (default: the tests' tiny model)")
    parser.add_argument("--before", type=Path, default=None, help="another checkout to compare with")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    trees = {"after": ROOT} if args.before is None else {"before": args.before.resolve(), "after": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(write_tiny_model(Path(tmp) / "tiny.gguf"))
        runs: dict[str, list[dict[int, dict]]] = {name: [] for name in trees}
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                runs[name].append(sweep(trees[name], model, args))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    med = lambda name, b, key: statistics.median(run[b][key] for run in runs[name])  # noqa: E731
    header = " | ".join(["B", *(f"{n} S_TG" for n in trees), "native S_TG", *(f"{n} / native" for n in trees)])
    print(f"| {header} |\n|" + " ---: |" * (1 + 2 * len(trees) + 1))
    for b in sizes:
        native = statistics.median(run[b]["native_s_tg"] for name in trees for run in runs[name])
        cells = [f"{med(n, b, 's_tg'):,.0f}" for n in trees] + [f"{native:,.0f}"] + [f"{med(n, b, 's_tg_ratio'):.2f}" for n in trees]
        print(f"| {b} | " + " | ".join(cells) + " |")
    print(f"\nmedians of {args.rounds} rounds; each ratio is the median of that tree's per-round S_TG / native S_TG")


if __name__ == "__main__":
    main()
