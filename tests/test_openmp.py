"""llama.cpp's CPU threads give their cores back soon after a decode (llamabatch.openmp)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A fresh interpreter, as a user's: llamabatch imported first. Prints the environment's spin count
# and the least CPU the process used in 100 ms of idling after a decode, over five decodes.
IDLE_AFTER_A_DECODE = """
import os, sys, time
from llamabatch import BatchEngine, SamplingParams
print(os.environ.get("GOMP_SPINCOUNT"))
with BatchEngine(sys.argv[1], n_parallel=1, n_ctx=256, n_threads=2) as engine:
    idle = []
    for _ in range(5):
        engine.generate(["hello"], SamplingParams(max_tokens=2, temperature=0))
        cpu = time.process_time()
        time.sleep(0.1)
        idle.append(time.process_time() - cpu)
print(min(idle))
"""


def idle_cpu(model, **env: str) -> tuple[str, float]:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", IDLE_AFTER_A_DECODE, str(model)], env={**clean, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    spin, seconds = done.stdout.split()
    return spin, float(seconds)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="libgomp spins briefly anyway where threads outnumber cores")
def test_llama_cpps_threads_sleep_soon_after_a_decode_unless_the_user_says_otherwise(tiny_model):
    """libgomp's own spin keeps a worker busy for milliseconds after every decode (7 ms on the
    benchmarks' EPYC); llamabatch loads it with a spin 30 times shorter, and puts the environment
    back (llama.cpp's own tools, run as children, get the user's). A spin count the user set stands."""
    spin, ours = idle_cpu(tiny_model)
    assert spin == "None"
    spin, theirs = idle_cpu(tiny_model, GOMP_SPINCOUNT="300000")  # libgomp's default, asked for
    assert spin == "300000"
    assert ours * 5 < theirs, (ours, theirs)
