"""A server stopping goes in order: new requests are refused (503), those in flight drain for
--shutdown-timeout, those still open then end with an error, the engine thread is joined and a
batch in progress is left synced for the next start. A real server (uvicorn, engine thread) in
this process, stopped as a signal stops it; every decode is slowed so that a long stream is still
going when the drain runs out."""

from __future__ import annotations

import json
import threading
import time

import httpx
import llama_cpp
import uvicorn

from conftest import free_port
from llamabatch.serve.app import ServerSettings, create_app
from llamabatch.serve.shutdown import ENDING_S, Server
from llamabatch.serve.store import Store

DRAIN_S = 1.0


def slow_decodes(monkeypatch, seconds: float) -> None:
    real = llama_cpp.llama_decode

    def decode(ctx, batch):
        time.sleep(seconds)
        return real(ctx, batch)

    monkeypatch.setattr(llama_cpp, "llama_decode", decode)


def start(tiny_model, data_dir) -> tuple[Server, threading.Thread, str]:
    engine = dict(model=tiny_model, n_parallel=3, n_ctx=3 * 1024, n_threads=2)
    app = create_app(ServerSettings(engine=engine, data_dir=data_dir, shutdown_timeout=DRAIN_S))
    port = free_port()
    server = Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=int(ENDING_S)),
                    app.state.models, DRAIN_S)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return server, thread, base
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError("server did not start")


def test_a_stopping_server_refuses_drains_ends_the_rest_and_leaves_its_batch_to_resume(tiny_model, tmp_path, monkeypatch):
    server, thread, base = start(tiny_model, tmp_path)
    slow_decodes(monkeypatch, 0.02)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"line {i}", "max_tokens": 8, "ignore_eos": True}} for i in range(200)]
    upload = httpx.post(f"{base}/v1/files", data={"purpose": "batch"},
                        files={"file": ("in.jsonl", "\n".join(json.dumps(r) for r in lines).encode())}).json()
    batch = httpx.post(f"{base}/v1/batches", json={"input_file_id": upload["id"], "endpoint": "/v1/completions",
                                                  "completion_window": "24h"}).json()
    output = tmp_path / "batches" / batch["id"] / "output.jsonl"
    deadline = time.monotonic() + 30
    while (not output.exists() or not output.read_bytes().count(b"\n")) and time.monotonic() < deadline:
        time.sleep(0.02)

    long_events: list[str] = []
    streaming = threading.Event()

    def long_stream() -> None:
        body = {"prompt": "a long answer", "max_tokens": 800, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    long_events.append(line[6:])
                    streaming.set()

    short: list[httpx.Response] = []
    threads = [threading.Thread(target=long_stream),
               threading.Thread(target=lambda: short.append(httpx.post(
                   f"{base}/v1/completions", json={"prompt": "short", "max_tokens": 16, "ignore_eos": True}, timeout=60)))]
    for t in threads:
        t.start()
    assert streaming.wait(30)

    stopped_at = time.monotonic()
    server.should_exit = True  # what SIGINT or SIGTERM does (uvicorn's handle_exit)
    time.sleep(0.3)  # uvicorn looks every 0.1 s; the drain has begun
    refused = httpx.post(f"{base}/v1/completions", json={"prompt": "late", "max_tokens": 4}, timeout=10)
    assert refused.status_code == 503 and "the server is stopping" in refused.json()["error"]["message"]
    assert httpx.get(f"{base}/health").status_code == 503

    for t in threads:
        t.join(timeout=30)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert time.monotonic() - stopped_at < DRAIN_S + ENDING_S + 5

    # the short request finished within the drain, whole
    [answer] = short
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"
    assert answer.json()["usage"]["completion_tokens"] == 16
    # the long stream did not: its last chunk is the error, then [DONE]; nothing said it finished
    *chunks, error, done = long_events
    assert done == "[DONE]"
    assert "the server is stopping" in json.loads(error)["error"]["message"]
    assert chunks and all(json.loads(c)["choices"][0]["finish_reason"] is None for c in chunks)
    # the batch is left in progress, its counts synced with what its output holds
    store = Store(tmp_path)  # the directory was released: the server closed its store
    try:
        row = store.batch(batch["id"])
    finally:
        store.close()
    written = output.read_bytes().count(b"\n")
    assert row["status"] == "in_progress" and 1 <= written < 200
    assert (row["completed"], row["failed"]) == (written, 0)
