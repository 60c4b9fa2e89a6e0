"""Streams that outlive their connection: Responses' background (created, asked after, followed
again from a sequence number, cancelled) through the official openai client, and completion
streams sent with X-Background followed again after a drop with Last-Event-ID. A stream without
either is cancelled when its client leaves, as always."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def resumable(serve, tmp_path_factory) -> str:
    return serve(n_parallel=2, n_ctx=2048, data_dir=tmp_path_factory.mktemp("resume") / "data")


def sse_events(lines) -> list[tuple[int | None, dict]]:
    """(id, data) of each event; id None where the event has none."""
    out, event_id = [], None
    for line in lines:
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: {"):
            out.append((event_id, json.loads(line[6:])))
            event_id = None
    return out


def wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_background_response_runs_is_asked_after_and_ends_completed(resumable):
    client = openai.OpenAI(base_url=f"{resumable}/v1", api_key="unused", max_retries=0)
    created = client.responses.create(model="tiny", input="hello", max_output_tokens=64, temperature=0, background=True)
    assert created.background and created.status in ("queued", "in_progress")
    wait_for(lambda: client.responses.retrieve(created.id).status not in ("queued", "in_progress"))
    done = client.responses.retrieve(created.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 64 and done.output_text
    direct = client.responses.create(model="tiny", input="hello", max_output_tokens=64, temperature=0)
    assert done.output_text == direct.output_text  # the same answer as in the foreground


def test_a_background_stream_is_followed_again_from_a_sequence_number_after_a_drop(resumable):
    client = openai.OpenAI(base_url=f"{resumable}/v1", api_key="unused", max_retries=0)
    stream = client.responses.create(model="tiny", input="hello", max_output_tokens=120, temperature=0, background=True, stream=True)
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta" and len(seen) > 6:
            break
    stream.close()  # the client drops; the response goes on
    response_id, last = seen[0].response.id, seen[-1].sequence_number
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=last))
    assert [e.sequence_number for e in rest] == list(range(last + 1, last + 1 + len(rest)))
    assert rest[-1].type == "response.incomplete"
    text = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    assert text == rest[-1].response.output_text  # every delta once, in order
    again = list(client.responses.retrieve(response_id, stream=True))  # from the start, while it is kept
    assert [e.sequence_number for e in again] == list(range(len(again))) and again[-1].type == "response.incomplete"


def test_a_background_response_is_cancelled_and_its_sequence_freed(resumable):
    client = openai.OpenAI(base_url=f"{resumable}/v1", api_key="unused", max_retries=0)
    created = client.responses.create(model="tiny", input="hello", max_output_tokens=1500, temperature=0, background=True)
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(created.id).status == "cancelled"
    wait_for(lambda: httpx.get(f"{resumable}/metrics").text.count('llamabatch_sequences_running{class="interactive",model="tiny"} 0.0') == 1)
    plain = client.responses.create(model="tiny", input="hi", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError, match="only those can be cancelled"):
        client.responses.cancel(plain.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")


def test_a_completion_stream_with_x_background_is_followed_again_with_last_event_id(resumable):
    body = {"prompt": "hello world", "stream": True, **LONG}
    with httpx.stream("POST", f"{resumable}/v1/completions", json=body, headers={"X-Background": "1"}, timeout=60) as r:
        stream_id = r.headers["x-stream-id"]
        first = []
        for line in r.iter_lines():
            first.append(line)
            if sum(x.startswith("data: {") for x in first) == 5:
                break  # the client drops
    got = sse_events(first)
    assert [i for i, _ in got] == list(range(5))
    with httpx.stream("GET", f"{resumable}/v1/streams/{stream_id}", headers={"Last-Event-ID": "4"}, timeout=60) as r:
        rest = sse_events(r.iter_lines())
    assert [i for i, _ in rest] == list(range(5, 5 + len(rest)))
    pieces = [c["text"] for _, e in got + rest for c in e["choices"]]
    alone = httpx.post(f"{resumable}/v1/completions", json={**body, "stream": False}, timeout=60).json()
    assert "".join(pieces) == alone["choices"][0]["text"] and rest[-1][1]["choices"][0]["finish_reason"] == "length"
    r = httpx.post(f"{resumable}/v1/completions", json={**body, "stream": False}, headers={"X-Background": "1"})
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]
    assert httpx.get(f"{resumable}/v1/streams/stream_nope").status_code == 404


def test_an_x_background_stream_is_cancelled_by_id_and_ends_there(resumable):
    body = {"prompt": "hello world", "stream": True, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{resumable}/v1/completions", json=body, headers={"X-Background": "1"}, timeout=60) as r:
        stream_id = r.headers["x-stream-id"]
    answer = httpx.post(f"{resumable}/v1/streams/{stream_id}/cancel").json()
    assert answer["status"] == "cancelled"
    with httpx.stream("GET", f"{resumable}/v1/streams/{stream_id}", timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert len(events) == answer["events"]  # it ended where it was cancelled
    running = 'llamabatch_sequences_running{class="interactive",model="tiny"} 0.0'
    wait_for(lambda: running in httpx.get(f"{resumable}/metrics").text)
