"""Which batch sizes llama-batched-bench itself runs on this build, and, where one fails, what
makes it fail: CUDA graphs, flash attention, or the tests' tiny model's shapes.

The one earlier GPU run stopped at B >= 32 with "CUDA error: an illegal instruction" in the
native tool as in llamabatch. This runs the native tool alone (no llamabatch in the process) at
each batch size, on the tests' tiny model and on a model of real shape; a run that fails is
run again with CUDA graphs off (GGML_CUDA_DISABLE_GRAPHS), with flash attention off, and with
kernel launches blocking (CUDA_LAUNCH_BLOCKING, so the error names the kernel that failed): at
the first batch size that fails, for each model.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from llamabatch.measure.sweep import native_tool

from .harness import progress, tiny_model
from .shapes import SHAPES, write_shape

SMOKE = ["--batch-sizes", "1,2", "--shape", "small"]

VARIANTS = {  # name -> (extra environment, extra arguments)
    "without CUDA graphs": ({"GGML_CUDA_DISABLE_GRAPHS": "1"}, []),
    "without flash attention": ({}, ["-fa", "off"]),
    "launches blocking": ({"CUDA_LAUNCH_BLOCKING": "1"}, []),
}


def arguments(parser) -> None:
    parser.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    parser.add_argument("--shape", default="gemma3-270m", choices=sorted(SHAPES), help="the model of real shape beside the tiny one")
    parser.add_argument("--gen-tokens", type=int, default=16)
    parser.add_argument("-ngl", "--gpu-layers", default="all")
    parser.add_argument("--timeout", type=float, default=60, help="seconds a run may take")


def run(args, report) -> None:
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny": tiny_model(Path(tmp)), args.shape: write_shape(Path(tmp) / f"{args.shape}.gguf", SHAPES[args.shape])}
        rows = []
        for name, model in models.items():
            label = "tests' tiny model" if name == "tiny" else f"{name} shape"
            tried = False
            for b in sizes:
                ok, why = attempt(model, b, args, {}, [])
                rows.append([label, b, "as built", "ok" if ok else "failed", why])
                report.figure(f"ok_{name}_b{b}", ok)
                if ok or tried:  # the variants at the first size that fails (time is short on a lent GPU)
                    continue
                tried = True
                for variant, (env, extra) in VARIANTS.items():
                    ok_then, why_then = attempt(model, b, args, env, extra)
                    rows.append([label, b, variant, "ok" if ok_then else "failed", why_then])
    report.table("llama-batched-bench alone, PP 32, TG " + str(args.gen_tokens), ["model", "B", "run", "result", "what it said last"], rows,
                 "A failed run is tried again once per variant; 'what it said last' is the end of its error output.")


def attempt(model: Path, b: int, args, env: dict, extra: list[str]) -> tuple[bool, str]:
    """One native run of batch size b: whether it ended well, and the last line of what it said about an error."""
    command = [str(native_tool()), "-m", str(model), "-c", str(b * (32 + args.gen_tokens) + 64), "-b", "2048", "-ub", "512",
               "-ngl", args.gpu_layers, "-npp", "32", "-ntg", str(args.gen_tokens), "-npl", str(b), "--output-format", "jsonl", *extra]
    progress(f"B={b} {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(extra)}".strip())
    try:
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=args.timeout, env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        return False, f"no end within {args.timeout:.0f} s"
    if done.returncode == 0:
        return True, ""
    lines = done.stderr.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower() or "failed" in line.lower()]
    return False, (errors or lines or [f"exit status {done.returncode}"])[-1][-200:]
