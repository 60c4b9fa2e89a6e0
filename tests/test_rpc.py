"""Layers on other hosts through llama.cpp's RPC backend, with two real RPC servers on
127.0.0.1 (`llamabatch rpc-server`: ggml's server from llama-cpp-python's own libraries)
standing in for the hosts.

These need a llama-cpp-python built with -DGGML_RPC=on. Elsewhere they skip, except where
LLAMABATCH_REQUIRE_RPC=1 (CI) makes a build without it a failure: a wheel cached without RPC
must not pass for one with it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import llama_cpp
import pytest

from conftest import free_port
from llamabatch.engine import BatchEngine, SamplingParams
from llamabatch.engine import rpc
from llamabatch.errors import ConfigError, ModelError
from test_batch import cli, lines, wait_for_lines, write_lines

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)

needs_rpc = pytest.mark.skipif(
    not llama_cpp.llama_supports_rpc() and os.environ.get("LLAMABATCH_REQUIRE_RPC") != "1",
    reason=f"llama-cpp-python built without RPC; rebuild: {rpc.rebuild_hint()}",
)


class RpcServer:
    """One `llamabatch rpc-server` process on 127.0.0.1."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llamabatch.cli", "rpc-server", "--port", str(self.port), "--threads", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                rpc.probe(self.endpoint, timeout=1)
                return
            except ModelError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"rpc-server on {self.endpoint} did not start: {self.proc.stderr.read()}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def servers():
    started = [RpcServer(), RpcServer()]
    yield started
    for server in started:
        server.stop()


def endpoints(servers: list[RpcServer]) -> str:
    return ",".join(s.endpoint for s in servers)


# -- settings ---------------------------------------------------------------------------


def test_endpoints_and_shares_are_read_as_llama_server_spells_them():
    assert rpc.parse_endpoints("10.0.0.2:50052, gpu-b:50053") == ("10.0.0.2:50052", "gpu-b:50053")
    assert rpc.parse_endpoints(["a:1", "b:2,c:3"]) == ("a:1", "b:2", "c:3")  # models.toml may list them
    assert rpc.parse_tensor_split("3,1") == (3.0, 1.0) and rpc.parse_tensor_split([1, 2]) == (1.0, 2.0)
    for bad, message in [("10.0.0.2", "HOST:PORT"), ("a:0", "HOST:PORT"), ("a:x", "HOST:PORT"), ("a:1,a:1", "twice")]:
        with pytest.raises(ConfigError, match=message):
            rpc.parse_endpoints(bad)
    for bad in ("1,x", "-1,2", "0,0"):
        with pytest.raises(ConfigError, match="--tensor-split"):
            rpc.parse_tensor_split(bad)


@pytest.mark.skipif(rpc.offloads(-1), reason="on a GPU build --tensor-split shares layers between local GPUs")
def test_remote_options_without_remotes_are_refused_not_ignored(tiny_model):
    # on this CPU build nothing is offloaded without --rpc: llama.cpp would ignore the shares
    with pytest.raises(ConfigError, match="--tensor-split shares offloaded layers .* add --rpc"):
        BatchEngine(tiny_model, tensor_split="1,1")
    with pytest.raises(ConfigError, match="--rpc-timeout applies to remotes"):
        BatchEngine(tiny_model, rpc_timeout=5)
    run = cli("run", "-m", tiny_model, "-p", "hello", "-ts", "1,1")
    assert run.returncode == 1 and "--tensor-split shares offloaded layers" in run.stderr


@needs_rpc
def test_modes_that_cannot_run_on_remotes_are_refused_before_loading(tiny_model):
    with pytest.raises(ConfigError, match="--deterministic .* drop --rpc"):
        BatchEngine(tiny_model, deterministic=True, rpc="127.0.0.1:9")
    from llamabatch.engine.sizing.options import EngineOptions

    with pytest.raises(ConfigError, match="KV cache lives on the remote hosts: give --memory"):
        EngineOptions(model=tiny_model, parallel="auto", rpc="127.0.0.1:9").engine_kwargs()


def test_a_build_without_rpc_is_told_how_to_rebuild(monkeypatch):
    # The one path this machine's RPC-enabled build cannot take for real: the support probe is replaced.
    monkeypatch.setattr(rpc.llama_cpp, "llama_supports_rpc", lambda: False)
    with pytest.raises(ConfigError, match=r'built without the RPC backend .*CMAKE_ARGS="-DGGML_RPC=on" pip install'):
        rpc.require_rpc()


# -- against real servers ---------------------------------------------------------------


@needs_rpc
def test_an_rpc_server_that_cannot_listen_says_why():
    """Not an address of this host, or a port in use: named, not guessed."""
    foreign = cli("rpc-server", "--host", "192.0.2.1", "--port", free_port())  # TEST-NET-1: nobody's
    assert foreign.returncode == 1 and "192.0.2.1 is not an address of this host" in foreign.stderr, foreign.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = cli("rpc-server", "--host", "127.0.0.1", "--port", port)
    assert busy.returncode == 1 and f"port {port} is taken" in busy.stderr, busy.stderr


def test_a_port_whose_connections_are_closing_is_free_to_listen_on():
    """A server just stopped leaves its port in TIME_WAIT: ggml's server binds it (SO_REUSEADDR),
    so the check before it must not call it taken (a remote restarted on its port)."""
    from llamabatch.cli.serving import _cannot_listen

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ggml's server listens
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server's side closes first: its port lingers in TIME_WAIT
            client.recv(1)
    assert _cannot_listen("127.0.0.1", port) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert _cannot_listen("127.0.0.1", taken.getsockname()[1]) == f"port {taken.getsockname()[1]} is taken"


@needs_rpc
def test_a_server_of_this_library_speaks_the_protocol_checked_before_loading(servers):
    major, minor, _ = rpc.probe(servers[0].endpoint)
    assert (major, minor) == rpc.PROTOCOL


@needs_rpc
def greedy_with_logprobs(engine: BatchEngine, prompts: list[str]) -> list[tuple[list[int], list[float]]]:
    sequences = engine.submit(prompts, GREEDY)
    for _ in engine.run():
        pass
    return [(seq.result().token_ids, [t.logprob for t in seq.logprobs]) for seq in sequences]


def test_layers_split_over_this_host_and_two_remotes_generate_what_one_host_does(tiny_model, servers):
    prompts = [f"the capital of {word} is" for word in ("France", "Spain", "Peru", "Chad", "Laos", "Fiji")]
    # Two slots: both engines decode the same batch compositions, so only the placement differs.
    with BatchEngine(tiny_model, n_parallel=2, n_ctx=1024, n_threads=1) as engine:
        assert engine.model.placement == ["CPU", "CPU", "CPU"]
        alone = greedy_with_logprobs(engine, prompts)
    # -ngl 2 of the tiny model's 2 layers + output: layer 0 stays here, layer 1 and the output
    # layer go to the two remotes (split 1:1), as llama-server --rpc A,B -ngl 2 -ts 1,1 places them.
    with BatchEngine(tiny_model, n_parallel=2, n_ctx=1024, n_threads=1, rpc=endpoints(servers), gpu_layers=2, tensor_split="1,1") as engine:
        here, first, second = engine.model.placement  # remotes are named RPC0, RPC1, ... in the order a process meets them
        assert here == "CPU" and first.startswith("RPC") and second.startswith("RPC") and first != second
        split = greedy_with_logprobs(engine, prompts)
    assert [tokens for tokens, _ in split] == [tokens for tokens, _ in alone]
    for (_, here), (_, there) in zip(alone, split):
        assert there == pytest.approx(here, abs=1e-5)


@needs_rpc
def test_a_closed_port_is_a_clear_error_at_load_in_the_api_and_the_cli(tiny_model):
    closed = f"127.0.0.1:{free_port()}"
    with pytest.raises(ModelError, match=f"cannot reach RPC server {closed}: Connection refused"):
        BatchEngine(tiny_model, rpc=closed)
    run = cli("run", "-m", tiny_model, "-p", "hello", "--rpc", closed)
    assert run.returncode == 1 and f"cannot reach RPC server {closed}" in run.stderr
    assert "Traceback" not in run.stderr and "Abort" not in run.stderr


@needs_rpc
def test_a_server_busy_with_another_engine_is_named_not_waited_on(tiny_model, servers):
    with BatchEngine(tiny_model, n_ctx=512, n_threads=1, rpc=servers[0].endpoint):
        # an rpc-server serves one client at a time: a second one would hang in ggml's handshake
        with pytest.raises(ModelError, match="did not answer within 1 s .*one client at a time"):
            rpc.probe(servers[0].endpoint, timeout=1)
    rpc.probe(servers[0].endpoint)  # free again once the engine closed


def start_job(tiny_model, servers: list[RpcServer], tmp_path, n: int, *extra) -> tuple[list, subprocess.Popen]:
    """`llamabatch batch` of n prompts on the remotes, in a process of its own; its arguments and process."""
    source = write_lines(tmp_path / "in.jsonl", [{"id": f"req-{i}", "prompt": f"hello {i} world"} for i in range(n)])
    args = ["batch", source, "-o", tmp_path / "out.jsonl", "-m", tiny_model, "--max-tokens", 32, "--temperature", 0,
            "--ignore-eos", "--parallel", 8, "--ctx", 2048, "--threads", 1, "--rpc", endpoints(servers), *extra]
    job = subprocess.Popen([sys.executable, "-m", "llamabatch.cli", *map(str, args)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    return args, job


@needs_rpc
def test_a_remote_killed_mid_job_stops_it_resumably_and_the_rerun_finishes_every_id_once(tiny_model, servers, tmp_path):
    args, job = start_job(tiny_model, servers, tmp_path, 600, "-ngl", 2)
    output = tmp_path / "out.jsonl"
    wait_for_lines(output, 40, job, timeout=120)
    victim = servers[1]
    victim.stop()
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == rpc.EXIT_BACKEND_LOST, stderr
    assert f"lost the RPC backend {victim.endpoint}" in stderr and "resumes" in stderr
    written = len(lines(output))
    assert 40 <= written < 600

    servers[1] = RpcServer(victim.port)  # the host is back
    resumed = cli(*args, "--json")
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout.splitlines()[-1])["summary"]
    assert summary["skipped"] == written and summary["done"] == 600 - written
    ids = Counter(line["id"] for line in lines(output))
    assert len(ids) == 600 and set(ids.values()) == {1}
    assert all(line["usage"]["completion_tokens"] == 32 for line in lines(output))


@needs_rpc
def test_models_toml_can_place_a_model_on_remotes(tiny_model, servers, tmp_path):
    catalog = tmp_path / "models.toml"
    catalog.write_text(
        f'[models.split]\npath = "{tiny_model}"\nrpc = ["{servers[0].endpoint}", "{servers[1].endpoint}"]\n'
        "tensor_split = [3, 1]\ngpu_layers = 2\n"
    )
    with BatchEngine("split", catalog=catalog, n_ctx=512, n_threads=1) as engine:
        assert engine.config.rpc == (servers[0].endpoint, servers[1].endpoint)
        assert engine.model.placement[0] == "CPU" and all(p.startswith("RPC") for p in engine.model.placement[1:])
        assert engine.generate(["hello"], GREEDY)[0].finish_reason == "length"


@needs_rpc
def test_a_remote_that_stops_answering_ends_the_job_after_the_timeout_instead_of_hanging(tiny_model, servers, tmp_path):
    _, job = start_job(tiny_model, servers, tmp_path, 400, "--rpc-timeout", 2)
    output = tmp_path / "out.jsonl"
    wait_for_lines(output, 20, job, timeout=120)
    os.kill(servers[0].proc.pid, signal.SIGSTOP)  # the host is still there for TCP, but never answers
    try:
        _, stderr = job.communicate(timeout=60)
    finally:
        os.kill(servers[0].proc.pid, signal.SIGCONT)
    assert job.returncode == rpc.EXIT_BACKEND_LOST, stderr
    assert "no answer for 2 s" in stderr and "resumes" in stderr
    assert Counter(line["id"] for line in lines(output)).most_common(1)[0][1] == 1
