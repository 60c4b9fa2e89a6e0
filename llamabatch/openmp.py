"""How long llama.cpp's CPU threads spin after a decode before they sleep.

A CPU build of llama.cpp runs each decode on OpenMP threads, and libgomp keeps each of them
spinning for 300,000 turns after its work ends (7 ms of a core after every decode on the 2-core
EPYC the benchmarks run on). Between two decodes the engine samples, detokenizes and serves on
those same cores, so the spin steals from it: 32 of Gemma 3's sampled rows at top-p draw on two
threads, one of which waits for a spinning core. 10,000 turns (0.4 ms there) still outlast the
gap between two decodes of a tight loop, so the threads are awake when the next one starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

SPIN_COUNT = "10000"


@contextmanager
def short_spin() -> Iterator[None]:
    """Load llama.cpp inside this block: libgomp reads GOMP_SPINCOUNT once, as it loads. The
    environment is put back after, so llama.cpp's own tools and other children get the user's.
    A spin count or wait policy the user set stands; a build that loads its CPU backend later
    (GGML_BACKEND_DL), or a process that loaded llama_cpp before llamabatch, keeps libgomp's."""
    ours = "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ
    if ours:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    try:
        yield
    finally:
        if ours:
            del os.environ["GOMP_SPINCOUNT"]
