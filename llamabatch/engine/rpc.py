"""llama.cpp's RPC backend: a model's layers on other hosts' devices, each reached over TCP
through an `rpc-server` (llama.cpp's, or `llamabatch rpc-server`).

llama-cpp-python binds only `llama_supports_rpc()`. The rest is reached here through ggml's
backend registry in llama-cpp-python's own libggml, as llama.cpp's `--rpc` does: the RPC
backend's `ggml_backend_rpc_add_server` turns an endpoint into devices, and the model takes
them in `llama_model_params.devices`. They are not registered process-wide (llama-server
registers them): a later model in this process, with other endpoints or none, must not find
a remote it never asked for.

ggml aborts the process when a remote cannot be reached or stops answering. So endpoints are
probed here first (a refused or silent host is a clear error before anything loads), and an
engine on remotes exits with `EXIT_BACKEND_LOST` and one line naming them when ggml gives up
on one mid-run: a batch job resumes from its files when run again, and a server's supervisor
sees it gone, instead of a healthy process behind a dead engine.
"""

from __future__ import annotations

import ctypes
import os
import re
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence
from importlib.metadata import version

import llama_cpp
from llama_cpp._ggml import libggml

from ..errors import ConfigError, ModelError

DEFAULT_PORT = 50052  # llama.cpp's rpc-server's
EXIT_BACKEND_LOST = 75  # sysexits' EX_TEMPFAIL: the same command, run again later, can succeed
# ggml-rpc.h (RPC_PROTO_*_VERSION) of the llama.cpp in the pinned llama-cpp-python: a server of
# another major version, or a newer minor one, fails ggml's handshake (an abort), so it is
# refused here first. tests/test_rpc.py checks it against a server from this very library.
PROTOCOL = (7, 0)
_HELLO = 14  # RPC_CMD_HELLO, fixed across versions
_CAPS = 24  # RPC_CONN_CAPS_SIZE: the hello carries the transport's capabilities (none here)

_CPU, _GPU, _IGPU = 0, 1, 2  # enum ggml_backend_dev_type

_vp, _size, _str = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
for _name, _args, _ret in (
    ("ggml_backend_reg_by_name", [_str], _vp),
    ("ggml_backend_reg_get_proc_address", [_vp, _str], _vp),
    ("ggml_backend_reg_dev_count", [_vp], _size),
    ("ggml_backend_reg_dev_get", [_vp, _size], _vp),
    ("ggml_backend_dev_count", [], _size),
    ("ggml_backend_dev_get", [_size], _vp),
    ("ggml_backend_dev_by_type", [ctypes.c_int], _vp),
    ("ggml_backend_dev_type", [_vp], ctypes.c_int),
    ("ggml_backend_dev_name", [_vp], _str),
    ("ggml_backend_dev_description", [_vp], _str),
):
    getattr(libggml, _name).argtypes, getattr(libggml, _name).restype = _args, _ret

_add_server_fn = ctypes.CFUNCTYPE(_vp, _str)
_start_server_fn = ctypes.CFUNCTYPE(None, _str, _str, _size, _size, ctypes.POINTER(_vp))
_abort_fn = ctypes.CFUNCTYPE(None, _str)
libggml.ggml_set_abort_callback.argtypes, libggml.ggml_set_abort_callback.restype = [_abort_fn], _abort_fn


def rebuild_hint() -> str:
    return (
        'CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-cache-dir --no-deps '
        f"llama-cpp-python=={version('llama-cpp-python')}"
    )


def require_rpc() -> ctypes.c_void_p:
    """The RPC backend's registry entry; a clear error where llama-cpp-python was built without it."""
    reg = libggml.ggml_backend_reg_by_name(b"RPC") if llama_cpp.llama_supports_rpc() else None
    if not reg:
        raise ConfigError(f"this llama-cpp-python was built without the RPC backend (--rpc); rebuild it with: {rebuild_hint()}")
    return reg


def parse_endpoints(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """`HOST:PORT[,HOST:PORT...]` (llama-server's --rpc), or a list of them, checked."""
    if not value:
        return ()
    items = value.split(",") if isinstance(value, str) else [part for item in value for part in str(item).split(",")]
    endpoints = tuple(item.strip() for item in items if item.strip())
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--rpc wants HOST:PORT[,HOST:PORT...], got {endpoint!r}")
    if len(set(endpoints)) != len(endpoints):
        raise ConfigError(f"--rpc names an endpoint twice: {','.join(endpoints)}")
    return endpoints


def parse_tensor_split(value: str | Sequence[float] | None) -> tuple[float, ...]:
    """`N0,N1,...` (llama-server's --tensor-split): each device's share of the offloaded layers."""
    if not value:
        return ()
    items = re.split(r"[,/]", value) if isinstance(value, str) else list(value)
    try:
        split = tuple(float(item) for item in items)
    except (TypeError, ValueError):
        raise ConfigError(f"--tensor-split wants numbers like 1,1 or 3,1, got {value!r}") from None
    if any(share < 0 for share in split) or not any(split):
        raise ConfigError(f"--tensor-split shares must be >= 0 and not all 0, got {value!r}")
    if len(split) > llama_cpp.LLAMA_MAX_DEVICES:
        raise ConfigError(f"--tensor-split has {len(split)} shares; llama.cpp takes at most {llama_cpp.LLAMA_MAX_DEVICES}")
    return split


def probe(endpoint: str, timeout: float = 5.0) -> tuple[int, int, int]:
    """Say hello to an RPC server as ggml will, and return its protocol version: a clear error
    for a host that refuses, stays silent, or speaks another version (where ggml would abort)."""
    try:
        size, major, minor, patch = _hello(endpoint, timeout)
    except TimeoutError:
        raise ModelError(
            f"RPC server {endpoint} did not answer within {timeout:g} s "
            "(an rpc-server serves one client at a time: is another process using it?)"
        ) from None
    except OSError as e:
        raise ModelError(f"cannot reach RPC server {endpoint}: {e.strerror or e} (is rpc-server running there?)") from None
    if size != 4 + _CAPS:
        raise ModelError(f"{endpoint} did not answer as an RPC server of llama.cpp")
    if major != PROTOCOL[0] or minor > PROTOCOL[1]:
        raise ModelError(
            f"RPC server {endpoint} speaks protocol {major}.{minor}.{patch}, this llama.cpp {PROTOCOL[0]}.{PROTOCOL[1]}: "
            "run the llama.cpp of the same version on both ends"
        )
    return major, minor, patch


def _hello(endpoint: str, timeout: float) -> tuple[int, int, int, int]:
    """The answer's size and version; OSError (TimeoutError: silent) where none comes."""
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(struct.pack("<BQ", _HELLO, _CAPS) + bytes(_CAPS))
        return struct.unpack("<QBBB", _receive(sock, 11))


def _receive(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError(104, "closed the connection during the handshake")
        data += chunk
    return data


def remote_devices(endpoints: Sequence[str]) -> list[int]:
    """Each endpoint's devices (ggml handles), in the order given (llama.cpp's tensor-split order)."""
    add_server = _add_server_fn(libggml.ggml_backend_reg_get_proc_address(require_rpc(), b"ggml_backend_rpc_add_server"))
    devices = []
    for endpoint in endpoints:
        probe(endpoint)
        reg = add_server(endpoint.encode())
        if not reg:
            raise ModelError(f"RPC server {endpoint} has no devices")
        devices += [libggml.ggml_backend_reg_dev_get(reg, i) for i in range(libggml.ggml_backend_reg_dev_count(reg))]
    return devices


def local_accelerators() -> list[int]:
    """This host's GPUs (integrated ones only where there is no discrete one), as ggml handles:
    with remotes, llama.cpp's own default device list is the remotes first, then these."""
    devices = [libggml.ggml_backend_dev_get(i) for i in range(libggml.ggml_backend_dev_count())]
    kinds = [libggml.ggml_backend_dev_type(d) for d in devices]
    gpus = [d for d, kind in zip(devices, kinds) if kind == _GPU]
    return gpus or [d for d, kind in zip(devices, kinds) if kind == _IGPU]


def devices() -> list[str]:
    """The devices llama.cpp sees in this process, by name and description (CPU, CUDA0, ...)."""
    handles = [libggml.ggml_backend_dev_get(i) for i in range(libggml.ggml_backend_dev_count())]
    return [f"{libggml.ggml_backend_dev_name(d).decode()} ({libggml.ggml_backend_dev_description(d).decode()})" for d in handles]


def offloads(gpu_layers: int) -> bool:
    """Whether layers leave this host's CPU for a local GPU. (llama_supports_gpu_offload() says
    yes for every RPC-enabled build, GPU or not.)"""
    return gpu_layers != 0 and any(libggml.ggml_backend_dev_by_type(kind) for kind in (_GPU, _IGPU))


class _Guard:
    """What ends this process when a remote is lost, while a model on remotes is loaded.

    ggml aborts when a connection breaks (a remote's process killed or crashed): the abort
    callback below turns that into exit status EXIT_BACKEND_LOST. ggml also waits for an answer
    without a timeout, so a host that vanishes without closing the connection (power, network)
    would hang a decode forever: a watchdog ends the process the same way once one decode has
    waited `timeout` seconds. Everything a job wrote is already on disk (its files survive a kill)."""

    def __init__(self) -> None:
        self.endpoints: tuple[str, ...] = ()
        self.timeout = 0.0
        self.since: float | None = None  # when the decode in flight began
        self._watchdog: threading.Thread | None = None

    def exit_when_lost(self, endpoints: Sequence[str], timeout: float) -> None:
        """While a model on these remotes is loaded, a remote lost (its connection broken, or a
        decode unanswered for `timeout` seconds) ends this process with EXIT_BACKEND_LOST and a
        line naming it, not a core dump or a hang. No endpoints: ggml's own abort again."""
        self.endpoints, self.timeout = tuple(endpoints), timeout
        libggml.ggml_set_abort_callback(_exit_on_abort if endpoints else _abort_fn())
        if endpoints and self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="rpc-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4) if self.endpoints else 1.0)
            since = self.since
            if self.endpoints and self.timeout > 0 and since is not None and time.monotonic() - since > self.timeout:
                self.exit(f"no answer for {self.timeout:g} s")

    def exit(self, reason: str) -> None:
        where = ", ".join(_unreachable(self.endpoints)) or ",".join(self.endpoints)
        sys.stderr.write(
            f"llamabatch: lost the RPC backend {where} ({reason}); stopping with exit status {EXIT_BACKEND_LOST}. "
            "A batch job resumes where it stopped when the same command runs again.\n"
        )
        sys.stderr.flush()
        os._exit(EXIT_BACKEND_LOST)


guard = _Guard()


@_abort_fn
def _exit_on_abort(message: bytes) -> None:
    # called on ggml's thread just before abort()
    guard.exit(message.decode(errors="replace").strip().rsplit(": ", 1)[-1])  # without ggml's file:line


def _unreachable(endpoints: Sequence[str]) -> list[str]:
    """The endpoints that refuse or drop a hello now. One still serving this process's other
    connection takes it into its backlog and stays silent: that one is alive."""
    down = []
    for endpoint in endpoints:
        try:
            _hello(endpoint, timeout=1.0)
        except TimeoutError:
            continue
        except OSError:
            down.append(endpoint)
    return down


def serve(host: str, port: int, threads: int) -> None:
    """Run ggml's RPC server on this host's accelerators (else its CPU) until the process ends:
    what llama.cpp's rpc-server does, from llama-cpp-python's own libraries."""
    start = _start_server_fn(libggml.ggml_backend_reg_get_proc_address(require_rpc(), b"ggml_backend_rpc_start_server"))
    devices = local_accelerators() or [libggml.ggml_backend_dev_by_type(_CPU)]
    handles = (_vp * len(devices))(*devices)
    start(f"{host}:{port}".encode(), None, threads, len(devices), handles)
