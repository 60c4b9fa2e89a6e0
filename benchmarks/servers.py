"""Servers the benchmarks start and drive: `llamabatch serve` and llama.cpp's llama-server, each on
a free loopback port for the length of a `with` block, and the native tools' paths."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx

from llamabatch.measure.sweep import native_tool

from .harness import cli


def native(tool: str) -> str:
    """A llama.cpp tool built by scripts/build_native.sh (the same llama.cpp as the binding)."""
    return str(native_tool(tool))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {base} did not start ({' '.join(process.args)})")


class Server:
    """A server process on a free loopback port, up (healthy) until the block ends."""

    def __init__(self, command: list[str], env: dict | None = None) -> None:
        self.env = None if env is None else {**os.environ, **env}
        self.port = free_port()
        self.command = [*command, "--port", str(self.port)]
        self.base = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env)
        try:
            wait_healthy(self.base, self.process)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait()


def llamabatch_serve(model: str | Path, *args, env: dict | None = None) -> Server:
    return Server(cli("serve", "-m", model, *args), env)


def llama_server(model: str | Path, *args) -> Server:
    return Server([native("llama-server"), "-m", str(model), "--no-webui", *map(str, args)])
