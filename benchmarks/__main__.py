"""python -m benchmarks --list | NAME [--smoke] [--out DIR] [options...] | report"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import tempfile
from pathlib import Path

from .harness import RESULTS, Report

# name -> module; each has a docstring (its first line describes it), SMOKE (the options of a
# tiny run, which CI makes of every benchmark), arguments(parser) and run(args, report).
BENCHMARKS = [
    "overhead", "sweep", "deterministic", "kv_layout", "samples", "admission", "score", "batch", "embeddings",
    "constraints", "speculative", "speculative_native", "cache_types", "lora", "priority", "serving", "rpc", "ray",
    "backend_sampling", "lm_eval", "families", "sampling", "tune", "prompt_cache", "models", "stall", "store", "gpu",
    "multimodal", "storm", "page", "native_faults", "overlap",
]


def module(name: str):
    return importlib.import_module(f"benchmarks.{name}")


def describe(name: str) -> str:
    return module(name).__doc__.strip().splitlines()[0]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nbenchmarks:\n" + "\n".join(f"  {n:20} {describe(n)}" for n in BENCHMARKS))
        return 0
    if argv[0] == "--list":
        for name in BENCHMARKS:
            print(f"{name:20} {describe(name)}")
        return 0
    if argv[0] == "report":
        from .report import main as report_main

        return report_main(argv[1:])
    name = argv[0]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}: python -m benchmarks --list", file=sys.stderr)
        return 2
    bench = module(name)
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=bench.__doc__)
    parser.add_argument("--smoke", action="store_true", help="a tiny run, to check the benchmark works (CI)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"folder for the results file (default: {RESULTS.relative_to(RESULTS.parent.parent)}; a temporary one with --smoke)")
    bench.arguments(parser)
    args = parser.parse_args(argv[1:])
    if args.smoke:  # the smoke sizes, then whatever the command line gives
        args = parser.parse_args(bench.SMOKE + argv[1:])
    report = Report(name, shlex.join(["python", "-m", "benchmarks", *_without_out(argv)]), args.smoke)
    bench.run(args, report)
    if args.smoke and args.out is None:  # a smoke's results are no results: written (so the writer runs), not kept
        with tempfile.TemporaryDirectory(prefix="llamabatch-smoke-") as folder:
            report.write(Path(folder))
        print("results: none kept (a smoke run)", file=sys.stderr)
        return 0
    print(f"results: {report.write(args.out or RESULTS)}", file=sys.stderr)
    return 0


def _without_out(argv: list[str]) -> list[str]:
    """The command as the results file records it: where this run wrote it is this machine's business."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--out="):
            skip = False
            continue
        skip = arg == "--out"
        if not skip:
            kept.append(arg)
    return kept


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
