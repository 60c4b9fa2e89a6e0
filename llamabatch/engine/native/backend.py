"""llama.cpp's process-wide state: the backend initialised once, its one log callback (echoed,
captured, its warnings kept), and calls that wait on the backends, timed while a model is on remotes."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import llama_cpp

from ...errors import ConfigError
from ..rpc import guard as rpc_guard


class _Process:
    """What this process has done with llama.cpp so far."""

    backend_ready = False
    # ggml reads GGML_CPU_TILED_MM once, at the process's first matmul: deterministic mode must
    # set it before anything is decoded.
    decoded = False


process = _Process()
GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_CONT = 3, 5  # ggml_log_level (ERROR is 4)
MAX_KEPT_WARNINGS = 64  # log pieces: a decode's complaint is a few lines


class _LogRouter:
    """llama.cpp logs through one process-wide callback: echoed to stderr when verbose, recorded
    while a caller captures it (the loader and the context report sizes only there), and its
    errors and warnings kept, so that a failed call can say what llama.cpp said about it."""

    def __init__(self) -> None:
        self.verbose = False
        self.captured: list[str] | None = None
        self.warnings: deque[str] = deque(maxlen=MAX_KEPT_WARNINGS)  # the latest WARN/ERROR messages' pieces (and their continuations)
        self.n_warnings = 0  # pieces ever kept: a mark, which the dropping of old pieces leaves valid
        self._warning = False  # the last message was one: a continuation (CONT) belongs to it

    def write(self, level: int, text: str) -> None:
        if self.verbose:
            sys.stderr.write(text)
        if self.captured is not None:
            self.captured.append(text)
        if level != GGML_LOG_LEVEL_CONT:
            self._warning = level >= GGML_LOG_LEVEL_WARN
        if self._warning:
            self.warnings.append(text)
            self.n_warnings += 1

    def said_since(self, mark: int) -> str:
        """What llama.cpp warned about since `mark` (n_warnings then; what is still kept of it), as one line."""
        new = min(self.n_warnings - mark, len(self.warnings))
        pieces = list(self.warnings)[-new:] if new else []
        return " ".join(" ".join(pieces).split())

    @contextmanager
    def capture(self) -> Iterator[list[str]]:
        """Collect the log while the block runs; the list holds its lines afterwards."""
        chunks: list[str] = []
        self.captured = chunks
        lines: list[str] = []
        try:
            yield lines
        finally:
            self.captured = None
            lines.extend("".join(chunks).splitlines())


log = _LogRouter()


@llama_cpp.llama_log_callback
def _on_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    log.write(level, text.decode(errors="replace"))


def route_log(set_callback) -> None:
    """Another native library's log (libmtmd's) into the same router, by its setter."""
    set_callback(_on_log, None)


def use_row_invariant_matmul() -> None:
    """Turn off ggml's tiled K-quant matmul, whose results depend on how many rows a batch has."""
    if os.environ.get("GGML_CPU_TILED_MM") == "0":
        return
    if process.decoded:
        raise ConfigError(
            "--deterministic must be chosen before this process decodes anything "
            "(ggml reads GGML_CPU_TILED_MM once); start a new process, or set GGML_CPU_TILED_MM=0"
        )
    os.environ["GGML_CPU_TILED_MM"] = "0"


def init_backend(verbose: bool = False) -> None:
    """Initialise llama.cpp once per process; its log goes to stderr only when verbose."""
    log.verbose = verbose
    llama_cpp.llama_log_set(_on_log, None)  # again each time: llama-cpp-python's Llama sets its own
    if not process.backend_ready:
        llama_cpp.llama_backend_init()
        process.backend_ready = True


def awaiting_backends(call, *args):
    """A call that may wait on the backends (decoding, or reading its outputs, which waits for
    the decode to finish): timed, while a model is on remotes, so that a remote which never
    answers is caught (rpc.guard)."""
    if not rpc_guard.endpoints:  # nothing remote to watch: every step's decode comes this way
        return call(*args)
    rpc_guard.since = time.monotonic()
    try:
        return call(*args)
    finally:
        rpc_guard.since = None
