"""What --deterministic costs: `llamabatch sweep` with and without it, in alternating processes.

ggml reads GGML_CPU_TILED_MM once per process, so the two modes cannot share one; pairs of
runs, one after the other, let slow drift of this machine hit both alike. Prints each batch
size's median S_TG and S_PP per mode and the median of the paired ratios.

    python scripts/bench_deterministic.py --pairs 8 --batch-sizes 1,8,16
    python scripts/bench_deterministic.py --pairs 4 --batch-sizes 1,16 --prompt-tokens 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

MODES = {"default": [], "deterministic": ["--deterministic"]}


def sweep(args: argparse.Namespace, extra: list[str]) -> dict[int, dict]:
    command = [sys.executable, "-m", "llamabatch.cli", "sweep", "--json", "--batch-sizes", args.batch_sizes,
               "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens), *extra]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return {p["batch_size"]: p for p in map(json.loads, out.splitlines())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--batch-sizes", default="1,8,16")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--gen-tokens", type=int, default=64)
    args = parser.parse_args()
    runs: dict[str, list[dict[int, dict]]] = {mode: [] for mode in MODES}
    for i in range(args.pairs):
        for mode, extra in MODES.items():
            runs[mode].append(sweep(args, extra))
        print(f"pair {i + 1}/{args.pairs} done", file=sys.stderr)
    print(f"{'B':>3} {'field':>5} {'default':>9} {'determ.':>9} {'ratio of medians':>17} {'median paired ratio':>20}")
    for b in map(int, args.batch_sizes.split(",")):
        for field in ("s_tg", "s_pp"):
            default = [run[b][field] for run in runs["default"]]
            det = [run[b][field] for run in runs["deterministic"]]
            paired = statistics.median(d / f for d, f in zip(det, default))
            ratio = statistics.median(det) / statistics.median(default)
            print(f"{b:>3} {field:>5} {statistics.median(default):9.1f} {statistics.median(det):9.1f} {ratio:17.3f} {paired:20.3f}")


if __name__ == "__main__":
    main()
