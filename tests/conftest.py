from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from llamabatch import BatchEngine  # before llama_cpp: llamabatch loads it (llamabatch.openmp)
import llama_cpp
from llamabatch.serve.app import ServerSettings, create_app
from llamabatch.serve.shutdown import Server

from tiny_model import FAMILIES, write_tiny_family, write_tiny_model

# Deterministic mode switches ggml to kernels whose results do not depend on a batch's rows, and
# ggml reads that switch once per process, at its first matmul. Setting it for the whole suite
# would leave no test running the kernels users get; so a test that builds a deterministic
# engine is marked fresh_process and runs alone in a new interpreter, as `llamabatch
# --deterministic` runs, where the engine sets the switch itself before anything decodes.
FRESH_PROCESS = "LLAMABATCH_TEST_FRESH_PROCESS"
# --parallel auto measures the batch size once per model and settings (llamabatch tune) and
# stores it: the suite's measurements go to a folder of its own, not the user's cache.
os.environ.setdefault("LLAMABATCH_TUNE_DIR", tempfile.mkdtemp(prefix="llamabatch-tune-"))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("fresh_process") is None or os.environ.get(FRESH_PROCESS):
        return None
    done = subprocess.run(
        [sys.executable, "-m", "pytest", pyfuncitem.nodeid, "-q", "-p", "no:cacheprovider"],
        cwd=pyfuncitem.config.rootpath, env={**os.environ, FRESH_PROCESS: "1"}, capture_output=True, text=True, timeout=900,
    )
    if done.returncode != 0 or " passed" not in done.stdout:
        pytest.fail(f"failed in a fresh process:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}", pytrace=False)
    return True


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_fim_model(tmp_path_factory) -> Path:
    """A tiny model with fill-in-the-middle tokens (prefix, suffix, middle, repository, file separator)."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-fim.gguf", fim=True)


@pytest.fixture(scope="session")
def tiny_eos_model(tmp_path_factory) -> Path:
    """A tiny model whose greedy choice is always the end-of-sequence token."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-eos.gguf", always_eos=True)


@pytest.fixture(scope="session", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[str, Path]:
    """Each recurrent or hybrid family in turn: its name and a tiny GGUF of it."""
    return request.param, write_tiny_family(tmp_path_factory.mktemp("families") / f"{request.param}.gguf", request.param)


@pytest.fixture
def make_engine(tiny_model):
    """Build engines on the tiny model (or another model); every one is closed after the test."""
    engines: list[BatchEngine] = []

    def make(model: Path | str | None = None, **settings) -> BatchEngine:
        settings = {"n_ctx": 2048, "n_parallel": 4, "n_threads": 2, **settings}
        engine = BatchEngine(model or tiny_model, **settings)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def decode_calls(monkeypatch) -> list[int]:
    """Return codes of every real llama_decode call made during the test."""
    codes: list[int] = []
    real = llama_cpp.llama_decode

    def counting(ctx, batch):
        codes.append(real(ctx, batch))
        return codes[-1]

    monkeypatch.setattr(llama_cpp, "llama_decode", counting)
    return codes


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until a job's output (written by a process) has n lines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        time.sleep(0.005)
    raise AssertionError(f"{path} did not reach {n} lines (exit code {proc.poll()})")


def native_built(tool: str) -> bool:
    """Whether scripts/build_native.sh built this llama.cpp tool (tests that compare with it skip otherwise)."""
    from llamabatch.errors import LlamabatchError
    from llamabatch.measure.sweep import native_tool

    try:
        return native_tool(tool).is_file()
    except LlamabatchError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve(tiny_model):
    """Start servers (real uvicorn, real engine thread) on free ports; all stopped afterwards."""
    servers = []

    def start(n_parallel: int = 4, n_ctx: int | None = None, engine_extra: dict | None = None, model: Path | None = None,
              **settings) -> str:
        engine = dict(model=model or tiny_model, n_parallel=n_parallel, n_ctx=n_ctx or 512 * n_parallel, n_threads=2, **(engine_extra or {}))
        app = create_app(ServerSettings(engine=engine, **settings))
        port = free_port()
        # The server `serve` runs, which drains in order when it stops (2 s here: nothing should be left)
        server = Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"), app.state.models, timeout=2)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    return base
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not start")

    yield start
    for server, _ in servers:
        server.should_exit = True
    for _, thread in servers:
        thread.join(timeout=10)
        assert not thread.is_alive(), "a server did not stop within 10 s"


@pytest.fixture(scope="module")
def base(serve) -> str:
    """A server with the default settings (4 slots), one per test module."""
    return serve()


@pytest.fixture(scope="module")
def client(base):
    """The official openai client, talking to `base`."""
    import openai  # a test dependency; imported here so conftest loads without it

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


class Faults:
    """llama_decode answering `code` for the next `times` calls (None: every call), and
    optionally taking `delay` seconds each time, real or not."""

    def __init__(self, monkeypatch, code: int | None = -1, times: int | None = 1, after: int = 0, delay: float = 0.0):
        self.code, self.left, self.after, self.delay = code, times, after, delay
        self.real = llama_cpp.llama_decode
        self.lock = threading.Lock()
        monkeypatch.setattr(llama_cpp, "llama_decode", self)

    def __call__(self, ctx, batch):
        time.sleep(self.delay)
        with self.lock:
            if self.after > 0:
                self.after -= 1
                return self.real(ctx, batch)
            if self.code is None or self.left == 0:
                return self.real(ctx, batch)
            if self.left is not None:
                self.left -= 1
        return self.code
