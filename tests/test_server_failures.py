"""A failure is never an answer: a failed step is a 500 for its own requests and the server goes
on; an engine that cannot go on makes /health 503 and fails what it held; the same request that
fails in the server fails the same way in a batch job. Faults are llama_decode's own return codes
(how a broken context or device reports itself), injected in the real server's process."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from llamabatch import BatchEngine
from llamabatch.jobs import BatchJob

from conftest import Faults


def client_of(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=60)


def test_a_failed_step_answers_500_and_the_next_request_200(serve, monkeypatch):
    base = serve(n_parallel=2)
    client = client_of(base)
    faults = Faults(monkeypatch, code=-1, times=1)
    with pytest.raises(openai.InternalServerError, match=r"llama_decode failed with code -1") as failed:
        client.completions.create(model="tiny", prompt="hello", max_tokens=8)
    assert failed.value.status_code == 500 and failed.value.body["type"] == "server_error"
    assert faults.left == 0
    ok = client.completions.create(model="tiny", prompt="hello", max_tokens=8, extra_body={"ignore_eos": True})
    assert (ok.choices[0].finish_reason, ok.usage.completion_tokens) == ("length", 8)
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}


def test_a_stream_whose_step_fails_gets_an_error_event_then_done(serve, monkeypatch):
    base = serve(n_parallel=2)
    Faults(monkeypatch, code=-1, times=1, after=4)  # the prompt and three tokens decode, then a step fails
    body = {"prompt": "hello", "max_tokens": 50, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    *chunks, error, done = events
    assert done == "[DONE]"
    assert json.loads(error)["error"]["code"] == 500 and "llama_decode failed" in json.loads(error)["error"]["message"]
    texts = [json.loads(c)["choices"][0] for c in chunks]
    # the four tokens sampled before it (a chunk each, but for half UTF-8 characters), never a "stop"
    assert 1 <= len(texts) <= 4 and all(c["finish_reason"] is None for c in texts)


def test_an_engine_that_cannot_go_on_fails_what_it_holds_and_health_says_503(serve, monkeypatch):
    base = serve(n_parallel=1)
    client = client_of(base)
    Faults(monkeypatch, code=-1, times=None, delay=0.3)  # every decode fails, slowly: all five are in by the third
    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(
            lambda i: httpx.post(f"{base}/v1/completions", json={"prompt": f"request {i}", "max_tokens": 4}, timeout=60),
            range(5),
        ))
    assert [a.status_code for a in answers] == [500] * 5  # three failed steps, and two queued requests failed with them
    assert sum("the engine stopped" in a.json()["error"]["message"] for a in answers) >= 2
    health = httpx.get(f"{base}/health")
    assert health.status_code == 503 and "3 engine steps failed in a row" in health.json()["error"]["message"]
    monkeypatch.undo()  # even with decoding fixed, the engine stays stopped until the server restarts
    with pytest.raises(openai.APIStatusError, match="the engine stopped") as refused:
        client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert refused.value.status_code == 503
    tokenize = httpx.post(f"{base}/tokenize", json={"prompt": "hello"})
    assert tokenize.status_code == 503  # the tokenizer routes do not reach into a stopped engine


def test_waiting_for_the_engine_to_take_a_request_has_a_timeout(serve, monkeypatch):
    base = serve(n_parallel=2, request_timeout=1.0)
    Faults(monkeypatch, code=None, delay=3.0)  # every decode real, and three seconds long
    first = ThreadPoolExecutor(1).submit(
        httpx.post, f"{base}/v1/completions", json={"prompt": "slow", "max_tokens": 50, "ignore_eos": True}, timeout=60)
    time.sleep(0.5)  # the engine thread is inside its first (long) step
    started = time.monotonic()
    second = httpx.post(f"{base}/v1/completions", json={"prompt": "next", "max_tokens": 2}, timeout=60)
    assert second.status_code == 504 and "did not take the request within 1 s" in second.json()["error"]["message"]
    assert time.monotonic() - started < 2.0  # answered at its deadline, not when the step ended
    assert first.result().status_code == 504


def test_a_request_that_fails_in_the_server_fails_alike_in_a_batch_job(serve, monkeypatch, tiny_model, tmp_path):
    """A full KV cache even for one sequence alone: 500 with the same body from the server and in
    the batch job's error file (its output body is, by design, the server's answer)."""
    base = serve(n_parallel=2)
    body = {"prompt": "hello", "max_tokens": 8}
    Faults(monkeypatch, code=1, times=None)  # 1: no KV slot for the batch, every time
    served = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert served.status_code == 500 and "KV cache full" in served.json()["error"]["message"]
    source = tmp_path / "requests.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    with BatchEngine(tiny_model, n_parallel=2, n_ctx=1024, n_threads=2) as engine:
        summary = BatchJob(engine, source, tmp_path / "out.jsonl").run()
    assert (summary.done, summary.failed) == (0, 1) and (tmp_path / "out.jsonl").read_text() == ""
    error = json.loads((tmp_path / "out.jsonl.errors.jsonl").read_text())
    assert error["response"]["status_code"] == 500 and error["response"]["body"] == served.json()


def test_a_batch_job_whose_engine_breaks_stops_resumably(tiny_model, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from llamabatch.cli import app

    source = tmp_path / "prompts.txt"
    source.write_text("".join(f"prompt {i}\n" for i in range(20)))
    Faults(monkeypatch, code=-1, times=None)
    args = ["batch", str(source), "-o", str(tmp_path / "out.jsonl"), "-m", str(tiny_model), "--max-tokens", "3",
            "--parallel", "2", "--temperature", "0"]
    broken = CliRunner().invoke(app, args)
    assert broken.exit_code == 1 and "the job stopped" in broken.output and "--retry-errors" in broken.output
    failed = (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()
    assert 0 < len(failed) < 20  # the failed steps' requests, not the whole job
    monkeypatch.undo()
    resumed = CliRunner().invoke(app, [*args, "--retry-errors"])
    assert resumed.exit_code == 0, resumed.output
    assert sorted(json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()) == \
        sorted(f"line-{i}" for i in range(1, 21))
