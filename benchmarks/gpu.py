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
import tarfile
import tempfile
import time
from pathlib import Path

from .harness import ROOT, progress
from .shapes import SHAPES, write_shape

SMOKE = ["--rehearse"]


def arguments(parser) -> None:
    parser.add_argument("--rehearse", action="store_true", help="tiny sizes on this machine's CPU (what CI runs)")
    parser.add_argument("--budget", type=float, default=540, help="seconds for every part together (the device tool's command runs at most 600)")
    parser.add_argument("--only", default=None, help="only the parts whose label holds one of these words (comma-separated): a second command")
    parser.add_argument("--pack", type=Path, default=None,
                        help="after each part, the --out folder packed into this tar file (the device tool brings back 8 files at most)")


def plan(args, shapes: Path) -> list[tuple[str, list[str]]]:
    """(label, the benchmark's command line) for each part, most important first; a sweep in two
    halves, so that a part cut by the time left loses less."""
    threads = str(os.cpu_count() or 2)

    def sweep(shape: str, sizes: str, gen: int, repeat: int, overlap: str) -> list[str]:
        return ["sweep", "--model", str(shape_path(shapes, shape)), "--batch-sizes", sizes, "--gen-tokens", str(gen),
                "--repeat", str(repeat), "--no-sequential", "--threads", threads, "--overlap", overlap]

    if args.rehearse:
        return [
            ("native batch sizes, small shape", ["native_faults", "--batch-sizes", "1,2", "--shape", "small", "--gen-tokens", "8"]),
            ("sweep, small shape", sweep("small", "1,2", 8, 1, "auto")),
            ("sweep, small shape, overlap off", sweep("small", "1,2", 8, 1, "off")),
            ("backend sampling, small shape", ["backend_sampling", "--model", str(shape_path(shapes, "small")), "-ngl", "-1",
                                               "--batch", "4", "--steps", "8", "--rounds", "1", "--threads", threads]),
            ("serving, small shape", ["serving", "--model", str(shape_path(shapes, "small")), "--clients", "2", "--requests", "4",
                                      "--max-tokens", "8", "--rounds", "1", "--sides", "llamabatch,llama-server"]),
            ("overhead, tiny model", ["overhead", "--rounds", "1", "--batch-sizes", "1,2", "--gen-tokens", "8"]),
            ("overlap on against off, small shape", ["overlap", "--model", str(shape_path(shapes, "small")), "--batch-sizes", "1,2",
                                                     "--gen-tokens", "8", "--rounds", "1", "--threads", threads]),
        ]
    gemma, llama = "gemma3-270m", "llama3.1-8b"

    def sampling(shape: str, b: int) -> list[str]:
        return ["backend_sampling", "--model", str(shape_path(shapes, shape)), "-ngl", "-1", "--batch", str(b), "--steps", "32",
                "--rounds", "3", "--threads", threads]

    def overlap(shape: str) -> list[str]:
        return ["overlap", "--model", str(shape_path(shapes, shape)), "--batch-sizes", "1,8,32,64,128,256", "--rounds", "3",
                "--threads", threads]

    sizes = "1,8,32,64,128,256"
    return [
        # What a loop that generates can reach against llama-batched-bench's, which never waits for an output.
        ("backend sampling, default model's shape, B 256", sampling(gemma, 256)),
        ("backend sampling, Llama 3.1 8B shape, B 256", sampling(llama, 256)),
        ("sweep, Llama 3.1 8B shape, B <= 32", sweep(llama, "1,8,32", 32, 2, "auto")),
        ("sweep, Llama 3.1 8B shape, B >= 64", sweep(llama, "64,128,256", 32, 2, "auto")),
        ("sweep, default model's shape", sweep(gemma, sizes, 32, 2, "auto")),
        ("sweep, default model's shape, a KV cache per sequence", [*sweep(gemma, sizes, 32, 2, "auto"), "--no-kv-unified"]),
        ("overlap on against off, default model's shape", overlap(gemma)),
        ("overlap on against off, Llama 3.1 8B shape", overlap(llama)),
        ("serving, default model's shape", ["serving", "--model", str(shape_path(shapes, gemma)), "--clients", "64,256",
                                            "--requests", "512", "--max-tokens", "32", "--rounds", "2",
                                            "--sides", "llamabatch,llama-server", "--threads", threads]),
        # The tests' tiny model faults in llama.cpp's CUDA kernels at B = 32 with 4096 KV cells or more, natively too
        # (docs/performance.md): its overhead split stays below.
        ("overhead, tiny model", ["overhead", "--rounds", "2", "--batch-sizes", "1,8,16", "--gen-tokens", "64", "--threads", threads]),
        ("native batch sizes (the B >= 32 fault)", ["native_faults", "--shape", gemma]),
    ]


def pack(folder: Path, archive: Path) -> None:
    """The folder's files into one tar file, replaced whole (a command cut short still leaves the last one)."""
    partial = archive.with_suffix(".partial")
    with tarfile.open(partial, "w") as tar:
        for path in sorted(folder.glob("*.json")):
            tar.add(path, arcname=path.name)
    partial.rename(archive)


def shape_path(folder: Path, name: str) -> Path:
    """The shape's model in `folder`, written on first use (a second command on the same machine finds it)."""
    path = folder / f"{name}.gguf"
    if not path.exists():
        started = time.perf_counter()
        write_shape(path.with_suffix(".partial"), SHAPES[name]).rename(path)
        progress(f"wrote {path.name} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.0f} s")
    return path


def run(args, report) -> None:
    args.smoke = args.smoke or args.rehearse  # a rehearsal's results are no results: not into benchmarks/results
    deadline = time.monotonic() + args.budget
    with tempfile.TemporaryDirectory(prefix="llamabatch-gpu-") as tmp:
        # On the lent machine the shapes stay for a second command; a rehearsal's go with it.
        shapes = Path(os.environ["LLAMABATCH_GPU_DIR"]) / "shapes" if "LLAMABATCH_GPU_DIR" in os.environ else Path(tmp)
        shapes.mkdir(parents=True, exist_ok=True)
        folder = args.out or (Path(tmp) if args.smoke else None)  # a smoke's results are no results
        parts = [(label, command) for label, command in plan(args, shapes)
                 if args.only is None or any(word in label for word in args.only.split(","))]
        run_parts(args, report, parts, ["--out", str(folder)] if folder is not None else [], deadline)


def run_parts(args, report, parts: list[tuple[str, list[str]]], out: list[str], deadline: float) -> None:
    rows = []
    for label, command in parts:
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
        if done.returncode != 0:  # what it said last, whole: the one line above rarely names the cause
            print("\n".join(done.stderr.strip().splitlines()[-40:]), flush=True)
        rows.append([label, status, f"{seconds:.0f} s", Path(written[0]).name if written else ""])
        if args.pack is not None and out:
            pack(Path(out[1]), args.pack)
        if done.returncode != 0 and args.rehearse:
            raise RuntimeError(f"{label} failed in the rehearsal:\n{done.stderr[-3000:]}")
    report.table("The prepared run's parts", ["part", "status", "time", "results file"], rows)
