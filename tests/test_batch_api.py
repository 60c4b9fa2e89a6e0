"""OpenAI's Files and Batches API on the server, driven by the official openai client: the whole
lifecycle, cancel, OpenAI's refusals, authentication, upload limits, priorities against
interactive requests, and a server killed with SIGKILL mid-batch that resumes on restart."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import free_port
from llamabatch.serve.access import Access
from test_server import metric

FINAL = ("completed", "failed", "cancelled", "expired")


def lines(n: int, max_tokens: int = 8, url: str = "/v1/completions", **body) -> list[dict]:
    return [{"custom_id": f"r{i}", "method": "POST", "url": url,
             "body": {"model": "tiny", "prompt": f"request number {i}", "max_tokens": max_tokens, "temperature": 0, **body}}
            for i in range(n)]


def upload(client: openai.OpenAI, rows: list[dict] | bytes, purpose: str = "batch"):
    data = rows if isinstance(rows, bytes) else "\n".join(json.dumps(r) for r in rows).encode()
    return client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose=purpose)


def wait(client: openai.OpenAI, batch_id: str, until=FINAL, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        time.sleep(0.1)
    raise TimeoutError(f"batch {batch_id} is still {batch.status}")


def jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def api(serve, tmp_path_factory):
    base = serve(n_parallel=4, data_dir=tmp_path_factory.mktemp("data"), max_upload=256 << 10)
    return base, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def test_the_openai_client_drives_a_batch_from_upload_to_output(api):
    base, client = api
    rows = lines(20) + [{"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "tiny", "prompt": "x", "temperature": -1}}]
    source = upload(client, rows)
    assert (source.object, source.purpose, source.bytes) == ("file", "batch", len("\n".join(json.dumps(r) for r in rows)))
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions", completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    batch = wait(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (21, 20, 1)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    output, errors = jsonl(client, batch.output_file_id), jsonl(client, batch.error_file_id)
    assert sorted(r["custom_id"] for r in output) == sorted(f"r{i}" for i in range(20))
    for record in output:
        body = record["response"]["body"]
        assert record["response"]["status_code"] == 200 and record["error"] is None
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 8
    assert batch.usage.output_tokens == 160 and batch.usage.input_tokens == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in output)
    [bad] = errors
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 400 and "temperature" in bad["error"]["message"]
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert metric(base, 'llamabatch_generated_tokens_total{class="batch"}') >= 160


def test_a_batch_whose_files_cannot_be_published_fails_saying_why_and_the_server_goes_on(api, monkeypatch):
    from llamabatch.serve.batch_runs import BatchRun

    _, client = api

    def full_disk(run):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(BatchRun, "_publish", full_disk)
    batch = wait(client, client.batches.create(input_file_id=upload(client, lines(3)).id, endpoint="/v1/completions",
                                               completion_window="24h").id)
    assert batch.status == "failed" and batch.request_counts.completed == 3
    assert "No space left on device" in batch.errors.data[0].message
    monkeypatch.undo()
    ok = client.completions.create(model="tiny", prompt="still here", max_tokens=4)
    assert ok.usage.completion_tokens >= 1


def test_chat_and_embedding_batches(api):
    _, client = api
    chat = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}} for i in range(3)]
    embed = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": "tiny", "input": f"text {i}"}}
             for i in range(3)]
    done = [wait(client, client.batches.create(input_file_id=upload(client, rows).id, endpoint=rows[0]["url"], completion_window="24h").id)
            for rows in (chat, embed)]
    assert [b.status for b in done] == ["completed", "completed"]
    chat_out, embed_out = (jsonl(client, b.output_file_id) for b in done)
    assert {r["response"]["body"]["object"] for r in chat_out} == {"chat.completion"}
    assert {len(r["response"]["body"]["data"][0]["embedding"]) for r in embed_out} == {64}


def test_listing_pages_as_openai_does(api):
    _, client = api
    source = upload(client, lines(1))
    ids = [client.batches.create(input_file_id=source.id, endpoint="/v1/completions", completion_window="24h").id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    assert [b.id for b in client.batches.list(limit=1, after=ids[1]).data] == [ids[0]]  # newest first, then older
    assert source.id in [f.id for f in client.files.list(purpose="batch")]
    for listing, noun in ((client.files.list, "file"), (client.batches.list, "batch")):
        with pytest.raises(openai.BadRequestError, match=f"after: no {noun} with id 'gone'"):
            listing(after="gone")
    for batch_id in ids:
        wait(client, batch_id)


def test_cancelling_midway_keeps_the_finished_requests(api):
    _, client = api
    source = upload(client, lines(300, max_tokens=200, ignore_eos=True))
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = wait(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    output = jsonl(client, batch.output_file_id)
    assert 4 <= len(output) < 300 and batch.request_counts.completed == len(output)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 200 for r in output)  # whole answers only
    with pytest.raises(openai.BadRequestError, match="cancelled"):
        client.batches.cancel(batch.id)


def test_malformed_inputs_get_openais_refusals(api):
    base, client = api
    with pytest.raises(openai.BadRequestError, match="not JSONL") as e:
        upload(client, b"this is not json\n")
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="purpose"):
        upload(client, lines(1), purpose="fine-tune")
    source = upload(client, lines(2))
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=source.id, endpoint="/v1/images/generations", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=source.id, endpoint="/v1/completions", completion_window="1h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    twice = lines(3)
    twice[2]["custom_id"] = "r0"
    mixed = lines(2) + lines(1, url="/v1/chat/completions")
    for rows, code, line in ((twice, "duplicate_custom_id", 3), (mixed, "mismatched_endpoint", 3)):
        batch = wait(client, client.batches.create(input_file_id=upload(client, rows).id, endpoint="/v1/completions",
                                                   completion_window="24h").id)
        assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
        assert [(err.code, err.line) for err in batch.errors.data] == [(code, line)]


def test_an_upload_over_the_limit_is_answered_413(api):
    base, _ = api
    big = b'{"custom_id": "x"}\n' * 14000  # 266 KB > 256 KiB
    reply = httpx.post(f"{base}/v1/files", files={"file": ("big.jsonl", big)}, data={"purpose": "batch"})
    assert reply.status_code == 413 and "more than the server takes" in reply.json()["error"]["message"]


def test_a_file_an_unfinished_batch_reads_cannot_be_deleted(api):
    _, client = api
    source = upload(client, lines(12, max_tokens=100, ignore_eos=True))
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="has not finished"):
        client.files.delete(source.id)
    wait(client, batch.id)
    assert client.files.delete(source.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(source.id)


def test_every_batch_route_wants_the_api_key(serve, tmp_path):
    base = serve(data_dir=tmp_path, access=Access(api_keys=frozenset({"secret"})))
    routes = [("post", "/v1/files"), ("get", "/v1/files"), ("get", "/v1/files/f"), ("delete", "/v1/files/f"),
              ("get", "/v1/files/f/content"), ("post", "/v1/batches"), ("get", "/v1/batches"), ("get", "/v1/batches/b"),
              ("post", "/v1/batches/b/cancel")]
    for method, path in routes:
        reply = httpx.request(method, base + path)
        assert reply.status_code == 401, (method, path, reply.status_code)
    keyed = openai.OpenAI(base_url=f"{base}/v1", api_key="secret", max_retries=0)
    assert keyed.files.list().data == []


def test_interactive_requests_go_before_a_running_batch(api):
    """Every slot busy with batch work: an interactive request preempts a batch sequence and
    finishes long before the batch does."""
    base, client = api
    batch = client.batches.create(input_file_id=upload(client, lines(8, max_tokens=300, ignore_eos=True)).id,
                                  endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 30
    while metric(base, 'llamabatch_sequences_running{class="batch"}') < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    preempted = metric(base, "llamabatch_priority_preemptions_total")
    reply = client.completions.create(model="tiny", prompt="urgent", max_tokens=8, temperature=0)
    assert reply.usage.completion_tokens == 8
    assert metric(base, "llamabatch_priority_preemptions_total") > preempted
    assert client.batches.retrieve(batch.id).status == "in_progress"  # the batch is still running
    assert wait(client, batch.id).request_counts.completed == 8  # and its preempted request finished in full


def test_openapi_documents_the_batch_api(api):
    base, _ = api
    paths = httpx.get(f"{base}/openapi.json").json()["paths"]
    for path in ("/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches", "/v1/batches/{batch_id}",
                 "/v1/batches/{batch_id}/cancel"):
        assert path in paths
    assert "multipart/form-data" in paths["/v1/files"]["post"]["requestBody"]["content"]


def _server(tiny_model: Path, data_dir: Path, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "llamabatch.cli", "serve", "-m", str(tiny_model), "--data-dir", str(data_dir),
               "--port", str(port), "--parallel", "4", "--threads", "2"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"server did not start: {process.stderr.read().decode()[-2000:]}")


def test_a_server_killed_mid_batch_resumes_it_and_answers_every_request_once(tiny_model, tmp_path):
    port = free_port()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    server = _server(tiny_model, tmp_path, port)
    try:
        rows = lines(120, max_tokens=48, ignore_eos=True)
        rows[7]["body"]["top_p"] = 0  # a request that fails, to the error file
        batch = client.batches.create(input_file_id=upload(client, rows).id, endpoint="/v1/completions", completion_window="24h")
        output = tmp_path / "batches" / batch.id / "output.jsonl"
        deadline = time.monotonic() + 60
        while (not output.exists() or output.read_bytes().count(b"\n") < 20) and time.monotonic() < deadline:
            time.sleep(0.01)
        server.send_signal(signal.SIGKILL)
        server.wait()
        written = output.read_bytes().count(b"\n")
        assert 20 <= written < 120
        server = _server(tiny_model, tmp_path, port)
        batch = wait(client, batch.id)
        assert batch.status == "completed"
        ids = [r["custom_id"] for r in jsonl(client, batch.output_file_id) + jsonl(client, batch.error_file_id)]
        assert sorted(ids) == sorted(r["custom_id"] for r in rows)  # each once: none lost, none twice
        assert (batch.request_counts.completed, batch.request_counts.failed) == (119, 1)
    finally:
        server.kill()
        server.wait()


def test_a_second_server_cannot_take_a_data_directory_in_use(tiny_model, tmp_path):
    port = free_port()
    first = _server(tiny_model, tmp_path, port)
    try:
        done = subprocess.run([sys.executable, "-m", "llamabatch.cli", "serve", "-m", str(tiny_model), "--data-dir", str(tmp_path),
                               "--port", str(free_port())], capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and "another llamabatch serve is using the data directory" in done.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=30)
    assert os.path.exists(tmp_path / "llamabatch.sqlite3")
