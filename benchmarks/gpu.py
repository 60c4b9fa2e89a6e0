"""The prepared GPU run: models of real shapes against llama.cpp's own tools, each benchmark's results file into --out.

What a lent GPU machine runs (scripts/gpu_run.sh bench, after scripts/gpu_run.sh build): the
sweep against llama-batched-bench at B = 1 to 256 on the default model's shape and Llama 3.1
8B's (random Q4_K/Q8_0 weights written there: benchmarks/shapes.py), serving against llama-server
at 64 and 256 clients on the default model's shape, and the overhead split on the tests' tiny
model. Each part is a `python -m benchmarks` run of its own, in the order of what matters most,
each within what is left of --budget seconds; a part that fails is recorded and the run goes on.
--rehearse runs the same on the CPU at tiny sizes (CI's smoke), so the run cannot rot between
GPU machines.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .harness import ROOT, progress
from .shapes import SHAPES, write_shape

SMOKE = ["--rehearse"]


def arguments(parser) -> None:
    parser.add_argument("--rehearse", action="store_true", help="tiny sizes on this machine's CPU (what CI runs)")
    parser.add_argument("--budget", type=float, default=540, help="seconds for every part together (the device tool's command runs at most 600)")


def plan(args) -> list[tuple[str, list[str]]]:
    """(label, the benchmark's command line) for each part, most important first."""
    threads = str(os.cpu_count() or 2)
    if args.rehearse:
        small = str(shape_path("small"))
        return [
            ("sweep, small shape", ["sweep", "--model", small, "--batch-sizes", "1,2", "--gen-tokens", "8", "--repeat", "1",
                                    "--no-sequential"]),
            ("serving, small shape", ["serving", "--model", small, "--clients", "2", "--requests", "4", "--max-tokens", "8",
                                      "--rounds", "1", "--sides", "llamabatch,llama-server"]),
            ("overhead, tiny model", ["overhead", "--rounds", "1", "--batch-sizes", "1,2", "--gen-tokens", "8"]),
        ]
    sizes = "1,8,32,64,128,256"
    return [
        ("sweep, Llama 3.1 8B shape", ["sweep", "--model", str(shape_path("llama3.1-8b")), "--batch-sizes", sizes,
                                       "--gen-tokens", "32", "--repeat", "2", "--no-sequential", "--threads", threads]),
        ("sweep, default model's shape", ["sweep", "--model", str(shape_path("gemma3-270m")), "--batch-sizes", sizes,
                                          "--gen-tokens", "32", "--repeat", "2", "--no-sequential", "--threads", threads]),
        ("serving, default model's shape", ["serving", "--model", str(shape_path("gemma3-270m")), "--clients", "64,256",
                                            "--requests", "512", "--max-tokens", "32", "--rounds", "1",
                                            "--sides", "llamabatch,llama-server", "--threads", threads]),
        ("overhead, tiny model", ["overhead", "--rounds", "2", "--batch-sizes", "1,8,32,64", "--gen-tokens", "64",
                                  "--threads", threads]),
    ]


_folder = Path(tempfile.mkdtemp(prefix="llamabatch-shapes-"))


def shape_path(name: str) -> Path:
    """The shape's model, written on first use."""
    path = _folder / f"{name}.gguf"
    if not path.exists():
        started = time.perf_counter()
        write_shape(path, SHAPES[name])
        progress(f"wrote {path.name} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.0f} s")
    return path


def run(args, report) -> None:
    deadline = time.monotonic() + args.budget
    folder = args.out or (Path(tempfile.mkdtemp(prefix="llamabatch-smoke-")) if args.smoke else None)  # a smoke's results are no results
    out = ["--out", str(folder)] if folder is not None else []
    rows = []
    for label, command in plan(args):
        left = deadline - time.monotonic()
        if left < 30:
            rows.append([label, "not run: out of time", "", ""])
            continue
        started = time.perf_counter()
        progress(f"== {label}: python -m benchmarks {' '.join(command)}")
        try:
            done = subprocess.run([sys.executable, "-m", "benchmarks", *command, *out], cwd=ROOT, capture_output=True,
                                  text=True, timeout=left, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except subprocess.TimeoutExpired:
            rows.append([label, "cut: out of time", f"{time.perf_counter() - started:.0f} s", ""])
            continue
        seconds = time.perf_counter() - started
        written = [line.removeprefix("results: ") for line in done.stderr.splitlines() if line.startswith("results: ")]
        status = "ok" if done.returncode == 0 else f"failed ({done.returncode}): {' '.join(done.stderr.strip().splitlines()[-1:])}"
        progress(f"   {status} in {seconds:.0f} s")
        print(done.stdout, flush=True)
        rows.append([label, status, f"{seconds:.0f} s", Path(written[0]).name if written else ""])
        if done.returncode != 0 and args.rehearse:
            raise RuntimeError(f"{label} failed in the rehearsal:\n{done.stderr[-3000:]}")
    report.table("The prepared run's parts", ["part", "status", "time", "results file"], rows)
