"""What a result was measured on: the CPU, cores and threads, the GPU if any, the llama.cpp build
(the binding's, and the native tools' when built) and the llamabatch commit."""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def machine() -> dict:
    import llama_cpp

    from llamabatch.engine.sizing.tuning import cpu_model  # here: a --before checkout's llamabatch may lay out otherwise

    llama_cpp.llama_backend_init()
    return {
        "host": platform.node(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpu": _gpu(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_system": llama_cpp.llama_print_system_info().decode().strip(),
        "native_build": _native_build(),
        **_commit(),
    }


def _commit() -> dict:
    """The llamabatch commit measured, and whether the tree differed from it. A copy of the tree
    whose .git is not its own (a lent GPU machine) names it in LLAMABATCH_COMMIT ("abc1234", or
    "abc1234-dirty": scripts/gpu_pack.sh writes it)."""
    named = os.environ.get("LLAMABATCH_COMMIT")
    if named:
        return {"llamabatch_commit": named.removesuffix("-dirty"), "llamabatch_dirty": named.endswith("-dirty")}
    return {"llamabatch_commit": _git("rev-parse", "--short", "HEAD"),
            "llamabatch_dirty": bool(_git("status", "--porcelain", "--untracked-files=no"))}


def _gpu() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True, text=True)
    return done.stdout.strip() or None


def _native_build() -> str | None:
    """llama.cpp's own build line (number and commit) from the native tools, if built."""
    from llamabatch.errors import LlamabatchError
    from llamabatch.measure.sweep import native_tool

    try:
        tool = native_tool()
    except LlamabatchError:
        return None
    done = subprocess.run([str(tool), "--version"], capture_output=True, text=True)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version:")]
    return lines[0].removeprefix("version:").strip() if lines else None


def _git(*args: str) -> str | None:
    done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip() if done.returncode == 0 else None
