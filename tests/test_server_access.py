"""Who may call the server: API keys (given, or from a file), /metrics kept private by choice,
browser origins (CORS), and HTTPS (a real `llamabatch serve` with a certificate made here)."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import openai
import pytest

from conftest import free_port
from llamabatch.serve.access import Access
from test_server import metric


def test_api_keys_are_asked_on_every_route_but_health(serve):
    base = serve(access=Access(api_keys=frozenset({"s3cret", "other"})))
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    for method, path in (("get", "/v1/models"), ("post", "/v1/completions"), ("post", "/tokenize"), ("get", "/lora-adapters"),
                         ("post", "/v1/messages"), ("post", "/models/load")):
        assert httpx.request(method, base + path, headers={"authorization": "s3cret"}).status_code == 401, path  # no "Bearer "
    for key in ("s3cret", "other"):
        good = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    message = anthropic.Anthropic(base_url=base, api_key="other", max_retries=0).messages.create(
        model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])  # x-api-key
    assert message.usage.output_tokens >= 1
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/metrics").status_code == 200  # open unless made private


def test_private_metrics_ask_for_a_key(serve):
    base = serve(access=Access(api_keys=frozenset({"k"}), private_metrics=True))
    assert httpx.get(f"{base}/metrics").status_code == 401
    assert "llamabatch_" in httpx.get(f"{base}/metrics", headers={"authorization": "Bearer k"}).text


def test_cors_lets_the_origins_given_call_and_no_others(serve):
    base = serve(access=Access(api_keys=frozenset({"k"}), cors_origins=("http://page.example",)))
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "authorization, content-type"}
    allowed = httpx.options(f"{base}/v1/chat/completions", headers={"origin": "http://page.example", **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://page.example"
    assert "POST" in allowed.headers["access-control-allow-methods"]
    refused = httpx.options(f"{base}/v1/chat/completions", headers={"origin": "http://elsewhere.example", **preflight})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    answered = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                          headers={"origin": "http://page.example", "authorization": "Bearer k"})
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "http://page.example"
    no_cors = serve()
    assert "access-control-allow-origin" not in httpx.get(f"{no_cors}/v1/models", headers={"origin": "http://page.example"}).headers


def test_the_command_line_reads_keys_from_a_file_and_refuses_what_cannot_work(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from llamabatch.cli import app

    def refused(*args: str) -> str:
        done = CliRunner().invoke(app, ["serve", "-m", str(tiny_model), *args])
        assert done.exit_code != 0
        return done.output

    (tmp_path / "empty").write_text("# no keys here\n\n")
    assert "holds no keys" in refused("--api-key-file", str(tmp_path / "empty"))
    assert "file not found" in refused("--api-key-file", str(tmp_path / "missing"))
    assert "--private-metrics asks for an API key" in refused("--private-metrics")
    assert "apply to the origins --cors-origin allows" in refused("--cors-methods", "GET")
    assert "both --ssl-certfile and --ssl-keyfile" in refused("--ssl-certfile", str(tmp_path / "empty"))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a certificate with")
def test_https_with_keys_from_a_file(tiny_model, tmp_path):
    """`serve --ssl-certfile --ssl-keyfile --api-key-file`: the official client, trusting the
    certificate made here, is answered over HTTPS; plain HTTP is not."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    (tmp_path / "keys").write_text("# the team's keys\nalpha\nbeta\n")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "llamabatch", "serve", "-m", str(tiny_model), "--parallel", "2", "--ctx", "1024", "--port", str(port),
         "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--api-key-file", str(tmp_path / "keys")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"https://127.0.0.1:{port}"
    trust = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"{base}/health", verify=trust).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert server.poll() is None, server.stderr.read()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="beta", max_retries=0, http_client=httpx.Client(verify=trust))
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="gamma", max_retries=0, http_client=httpx.Client(verify=trust)).models.list()
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health")
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_waiting_stream_sends_keepalive_comments_and_clients_skip_them(serve):
    """One slot, busy: a second stream waits in the queue, sending an SSE comment every 0.2 s
    until its first token; the official client reads such a stream as if they were not there."""
    base = serve(n_parallel=1, n_ctx=4096, keepalive=0.2)
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}

    def behind_a_busy_slot(read):
        busy = threading.Thread(target=httpx.post, args=(f"{base}/v1/completions",),
                                kwargs={"json": {"prompt": "hi", "max_tokens": 3000, "ignore_eos": True}, "timeout": 120})
        busy.start()
        while metric(base, "llamabatch_sequences_running") < 1:  # it holds the slot: the next one waits
            time.sleep(0.01)
        try:
            return read()
        finally:
            busy.join()

    def raw() -> list[str]:
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True, "ignore_eos": True}, timeout=120) as response:
            return [line for line in response.iter_lines() if line]

    lines = behind_a_busy_slot(raw)
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert first_data >= 2 and all(line == ": keep-alive" for line in lines[:first_data])
    assert lines[-1] == "data: [DONE]"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0)
    chunks = behind_a_busy_slot(lambda: list(client.completions.create(model="tiny", stream=True, extra_body={"ignore_eos": True}, **body)))
    assert "".join(c.choices[0].text for c in chunks) == "".join(
        json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith("data: {"))
