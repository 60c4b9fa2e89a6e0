"""`llamabatch serve` on 127.0.0.1 with the tiny model, driven by the official openai client and httpx."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

from llamabatch import BatchEngine, SamplingParams
from llamabatch.serve.app import ServerSettings, create_app

from conftest import free_port


def metric(base: str, name: str) -> float:
    """A sample of /metrics, named with its labels but the model (the one these servers hold)."""
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        unlabelled = re.sub(r'\{,|,\}|,,', lambda m: {"{,": "{", ",}": "}", ",,": ","}[m[0]], re.sub(r'model="[^"]*"', "", line)).replace("{}", "")
        if unlabelled.startswith(name + " ") or unlabelled.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_completion_equals_the_engine_and_reports_usage(client, tiny_model):
    reply = client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    with BatchEngine(tiny_model, n_parallel=1, n_threads=2) as engine:
        expected = engine.generate(["hello world"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert reply.choices[0].text == expected.text and reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (expected.prompt_tokens, 8)
    assert reply.usage.total_tokens == expected.prompt_tokens + 8


def test_a_list_of_prompts_with_n_samples_gives_every_choice(client):
    reply = client.completions.create(model="tiny", prompt=["hello", "Once upon a time"], n=2, max_tokens=4, seed=3,
                                      extra_body={"ignore_eos": True})
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    assert reply.usage.completion_tokens == 16


def test_streamed_chunks_add_up_to_the_whole_completion(client):
    settings = dict(model="tiny", prompt="the capital of France is", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**settings).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **settings))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices  # the usage chunk, as asked
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.completions.create(stream=True, **settings))
    assert all(c.choices and c.usage is None for c in plain)  # not asked: no usage chunk, as OpenAI does


def test_stop_strings_cut_the_text(client):
    full = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[5:7]
    cut = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_chat_completion_whole_and_streamed(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    settings = dict(model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**settings)
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 6
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **settings) if c.choices)
    assert streamed == whole.choices[0].message.content


def test_models_health_and_batch_endpoint(base, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    reply = httpx.post(f"{base}/v1/batch/completions", json={"prompts": ["a", "bb", "ccc"], "max_tokens": 3, "ignore_eos": True}).json()
    assert [r["index"] for r in reply["results"]] == [0, 1, 2]
    assert all(r["usage"]["completion_tokens"] == 3 and r["timings"]["ttft_s"] > 0 for r in reply["results"])
    assert reply["usage"]["completion_tokens"] == 9 and reply["timings"]["wall_s"] > 0


def test_concurrent_requests_share_decode_steps(base, client):
    before = metric(base, "llamabatch_active_sequences_per_decode_sum") / max(1, metric(base, "llamabatch_active_sequences_per_decode_count"))

    def ask(i: int) -> int:
        reply = client.completions.create(model="tiny", prompt=f"request {i}", max_tokens=40, extra_body={"ignore_eos": True})
        return reply.usage.completion_tokens

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, range(4))) == [40] * 4
    total = metric(base, "llamabatch_active_sequences_per_decode_sum")
    steps = metric(base, "llamabatch_active_sequences_per_decode_count")
    ones = metric(base, 'llamabatch_active_sequences_per_decode_bucket{le="1.0"}')
    assert total / steps > before and ones < steps  # some decodes carried several requests' sequences


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(base, client):
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it is generating
    deadline = time.monotonic() + 10
    while metric(base, "llamabatch_sequences_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(base, "llamabatch_sequences_running") == 0  # cancelled long before 400 tokens
    reply = client.completions.create(model="tiny", prompt="still fine", max_tokens=5, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 5


def test_a_full_queue_answers_429_with_retry_after(serve):
    base = serve(n_parallel=1, max_queue=1, n_ctx=8192)
    url = f"{base}/v1/completions"
    long = {"prompt": "slow", "max_tokens": 8000, "stream": True, "ignore_eos": True}
    pool = ThreadPoolExecutor(1)
    with httpx.stream("POST", url, json=long, timeout=60) as first:
        lines = first.iter_lines()  # kept: a dropped iterator closes the connection
        assert next(lines)  # it holds the only slot
        second = pool.submit(httpx.post, url, json={"prompt": "next", "max_tokens": 5}, timeout=60)
        deadline = time.monotonic() + 10
        while metric(base, "llamabatch_sequences_queued") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        refused = httpx.post(url, json=long)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
    assert second.result().status_code == 200  # the queued request ran once the first client left
    pool.shutdown()


def test_bad_json_and_bad_parameters_are_400_with_an_openai_error(base, client):
    bad_json = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "error" in bad_json.json()
    with pytest.raises(openai.BadRequestError, match="temperature: Input should be greater than or equal to 0"):
        client.completions.create(model="tiny", prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="prompt: String should have at least 1 character"):
        client.completions.create(model="tiny", prompt="")
    missing = httpx.post(f"{base}/v1/completions", json={"max_tokens": 3})
    assert missing.status_code == 400 and "prompt" in missing.json()["error"]["message"]


def test_streams_follow_the_sse_format(base):
    body = {"prompt": "hi", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def test_return_progress_streams_how_far_a_long_prompt_has_been_read(serve):
    """llama-server's return_progress: a chunk with prompt_progress after each step that read a
    chunk of the prompt (64-token chunks here), before the first token; the text is unchanged,
    and the openai client reads such chunks (no choices) as it reads the usage chunk."""
    base = serve(n_parallel=2, engine_extra={"n_batch": 64, "n_ubatch": 64})
    prompt = [259 + k % 31 for k in range(300)]  # the tiny vocabulary's word pieces
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}

    def events(extra: dict) -> list[dict]:
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, **extra}) as response:
            return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]

    shown, plain = events({"return_progress": True}), events({})
    progress = [e["prompt_progress"] for e in shown if "prompt_progress" in e]
    total = progress[-1]["total"]
    assert total == 300 and [p["processed"] for p in progress] == sorted({min(total, 64 * k) for k in range(1, total // 64 + 2)})
    assert all(p["total"] == total and p["cache"] == 0 and p["time_ms"] >= 0 for p in progress)
    assert shown.index(next(e for e in shown if e["choices"])) > len(progress) - 1  # every progress chunk before the text
    assert [c["text"] for e in shown for c in e["choices"]] == [c["text"] for e in plain for c in e["choices"]]
    assert not any("prompt_progress" in e for e in plain)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=2,
                                                 stream=True, extra_body={"return_progress": True}))
    assert any(getattr(c, "prompt_progress", None) for c in chunks) and any(c.choices for c in chunks)


def count(base: str, name: str) -> float:
    """A series that shows from its first observation: 0 before."""
    try:
        return metric(base, name)
    except KeyError:
        return 0


def steps(base: str) -> float:
    """Engine steps so far."""
    return count(base, "llamabatch_step_seconds_count")


@pytest.mark.parametrize("stream", [False, True], ids=["answered whole", "streamed"])
def test_a_long_prompt_beside_an_answer_given_whole_is_read_in_whole_chunks(serve, stream):
    """A step budget far shorter than a step (the fewest prompt tokens a step may carry) keeps a
    streamed request's tokens flowing: a long prompt beside it is read in pieces of at most 32
    tokens. Beside a request answered whole no one sees the gaps: the prompt is read in whole
    chunks, and its first token comes sooner."""
    base = serve(n_parallel=2, n_ctx=4096, engine_extra={"step_target": 1e-6})
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

    def decode() -> float:
        reply = client.completions.create(model="tiny", prompt="a decoder", max_tokens=1800, temperature=0, stream=stream,
                                          extra_body={"ignore_eos": True})
        if stream:
            assert sum(len(c.choices[0].text) for c in reply if c.choices) > 0
        return time.monotonic()

    with ThreadPoolExecutor(1) as pool:
        decoder = pool.submit(decode)
        while steps(base) < 8:  # its prompt, then decode steps (what one costs)
            time.sleep(0.01)
        reader = client.completions.create(model="tiny", prompt=" ".join(f"apple{i}" for i in range(120)), max_tokens=1, temperature=0)
        read_at = time.monotonic()
        assert decoder.result() > read_at, "the decoder ended before the long prompt was read: give it more tokens"
    assert reader.usage.prompt_tokens > 512
    long_steps = metric(base, "llamabatch_step_prompt_tokens_count") - metric(base, 'llamabatch_step_prompt_tokens_bucket{le="32.0"}')
    assert (long_steps > 0) == (not stream)


@pytest.mark.fresh_process
def test_a_deterministic_server_answers_the_same_alone_and_under_load(serve):
    client = openai.OpenAI(base_url=f"{serve(n_parallel=4, engine_extra={'deterministic': True})}/v1", api_key="-", max_retries=0)

    def ask(prompt: str):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, logprobs=1,
                                         extra_body={"ignore_eos": True}).choices[0]

    alone = ask("word " * 60)
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(ask, p) for p in ["hello", "a b c", "Once upon a time"]]
        together = pool.submit(ask, "word " * 60).result()
        [f.result() for f in others]
    assert together.text == alone.text
    assert together.logprobs.token_logprobs == alone.logprobs.token_logprobs  # bit for bit


def test_logprobs_of_each_token_with_alternatives(client):
    reply = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0, logprobs=3,
                                      extra_body={"ignore_eos": True})
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen <= 0  # a dict by text: byte tokens that render alike collide
        assert chosen >= max(top.values()) - 1e-6  # greedy picks the most likely token
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)
    plain = client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_a_request_past_its_timeout_is_cancelled_with_504(serve):
    base = serve(n_parallel=1, n_ctx=8192, request_timeout=0.5)
    whole = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 8000, "ignore_eos": True}, timeout=30)
    assert whole.status_code == 504 and "longer than 0.5 s" in whole.json()["error"]["message"]
    body = {"prompt": "x", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
        *_, error, done = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert json.loads(error[6:])["error"]["code"] == 504 and done == "data: [DONE]"
    assert metric(base, "llamabatch_sequences_running") == 0


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_waiting_client_that_hangs_up_frees_its_sequence(serve):
    base = serve(n_parallel=1, n_ctx=8192)  # 8000 tokens take seconds: long enough to hang up
    generated = metric(base, "llamabatch_generated_tokens_total")
    body = {"prompt": "x", "max_tokens": 8000, "ignore_eos": True}
    waiting = ThreadPoolExecutor(1).submit(httpx.post, f"{base}/v1/completions", json=body, timeout=1.0)
    assert wait_for(lambda: metric(base, "llamabatch_kv_cells_used") > 10)  # it is generating
    assert metric(base, "llamabatch_sequences_running") == 1
    with pytest.raises(httpx.ReadTimeout):
        waiting.result()  # the client hangs up
    assert wait_for(lambda: metric(base, "llamabatch_sequences_running") == 0, 1.5)
    # a whole answer's tokens are counted as it ends, cancelled too
    assert 0 < metric(base, "llamabatch_generated_tokens_total") - generated < 8000  # cut short


@pytest.mark.parametrize("kind", ["corrupt", "diffusion", "encoder-decoder"])
def test_health_is_503_with_the_reason_when_the_model_cannot_load(kind, tmp_path):
    from tiny_model import write_tiny_model, write_tiny_t5

    if kind == "corrupt":
        model, reason = tmp_path / "broken.gguf", "could not load"
        model.write_bytes(b"GGUF" + b"\0" * 64)
    elif kind == "diffusion":
        model, reason = write_tiny_model(tmp_path / "dream.gguf", diffusion=True), "is a diffusion model"
    else:  # T5 would abort the process at its first decode
        model, reason = write_tiny_t5(tmp_path / "t5.gguf"), "has an encoder"
    app = create_app(ServerSettings(engine=dict(model=model, n_parallel=1, n_ctx=256)))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health")
                if "failed to load" in health.text:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        assert health.status_code == 503 and "failed to load" in health.json()["error"]["message"]
        assert reason in health.json()["error"]["message"]
        refused = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503 and reason in refused.json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_serve_refuses_an_unknown_model_before_listening():
    from typer.testing import CliRunner

    from llamabatch.cli import app

    result = CliRunner().invoke(app, ["serve", "-m", "no-such-model"])
    assert result.exit_code == 1 and "no-such-model" in result.output


def test_a_client_that_stops_reading_its_stream_is_cancelled(serve):
    base = serve(n_parallel=8, n_ctx=8 * 4096)
    port = int(base.rsplit(":", 1)[1])
    generated = metric(base, "llamabatch_generated_tokens_total")
    # 8 streams of up to 4000 tokens, ~1 KB per chunk with 20 alternatives: they outgrow the
    # socket buffers (4 MiB here) within a few seconds once the client stops reading
    body = {"prompt": "x", "max_tokens": 4000, "n": 8, "ignore_eos": True, "stream": True, "logprobs": 20}
    data = json.dumps(body).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        # it is generating (never read from sock from here on)
        assert wait_for(lambda: metric(base, "llamabatch_generated_tokens_total") > generated + 8 * 10)
        assert wait_for(lambda: metric(base, "llamabatch_sequences_running") == 0, 20)
    assert metric(base, "llamabatch_generated_tokens_total") - generated < 0.75 * 8 * 4000  # cut short


def test_a_server_with_a_draft_model_answers_as_without_and_counts_drafts(serve, client, tiny_model):
    """Concurrent requests with the tiny model drafting for itself: the answers equal the plain
    server's, and /metrics counts drafts verified and kept."""
    fast_base = serve(engine_extra={"draft_model": tiny_model, "draft_max": 4})
    fast = openai.OpenAI(base_url=f"{fast_base}/v1", api_key="unused", max_retries=0)
    prompts = ["hello world", "Once upon a time", "the capital of France is", "def fib(n):"]

    def answers(c: openai.OpenAI) -> list[str]:
        with ThreadPoolExecutor(4) as pool:
            replies = pool.map(lambda p: c.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0,
                                                              extra_body={"ignore_eos": True}), prompts)
            return [r.choices[0].text for r in replies]

    assert answers(fast) == answers(client)
    assert metric(fast_base, "llamabatch_draft_tokens_total") >= 8
    assert metric(fast_base, "llamabatch_draft_tokens_accepted_total") > 0.9 * metric(fast_base, "llamabatch_draft_tokens_total")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800"}]}]}'),
    ("/v1/embeddings", '{"input": "a\\ud800b"}'),
    ("/tokenize", '{"prompt": "a\\ud800b"}'),
    ("/tokenize", '{"content": "a\\ud800b"}'),
])
def test_half_a_surrogate_pair_is_refused_not_a_server_error(base, path, body):
    """JSON can escape a lone surrogate, which no UTF-8 text holds: 400, never 500."""
    reply = httpx.post(base + path, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def test_a_json_schema_llguidance_cannot_read_is_refused_not_a_server_error(base):
    body = {"prompt": "x", "max_tokens": 2, "json_schema": {"type": "integer", "maximum": 2**70}}
    reply = httpx.post(f"{base}/v1/completions", json=body)
    assert reply.status_code == 400 and "invalid JSON schema" in reply.json()["error"]["message"]


def test_prompts_are_tokenized_and_constraints_compiled_off_the_engine_thread(serve, monkeypatch):
    """The engine thread steps every stream: a request's text is tokenized, and its constraint
    compiled, before that thread takes it (a large schema's compile must not stall the others)."""
    from llamabatch.engine.sampling.constraints import Grammars
    from llamabatch.engine.native.handles import Vocab

    threads: dict[str, list[str]] = {"tokenize": [], "compile": []}

    def recorded(name, method):
        def call(*args, **kwargs):
            threads[name].append(threading.current_thread().name)
            return method(*args, **kwargs)
        return call

    monkeypatch.setattr(Vocab, "tokenize", recorded("tokenize", Vocab.tokenize))
    monkeypatch.setattr(Grammars, "compile", recorded("compile", Grammars.compile))
    base = serve(n_parallel=2)
    schema = {"enum": ["yes", "no"]}
    plain = httpx.post(f"{base}/v1/completions", json={"prompt": "one two three", "max_tokens": 4}, timeout=30)
    constrained = httpx.post(f"{base}/v1/completions", json={"prompt": "yes or no:", "max_tokens": 12, "json_schema": schema}, timeout=30)
    assert plain.status_code == 200 and constrained.status_code == 200
    assert json.loads(constrained.json()["choices"][0]["text"]) in ("yes", "no")
    assert len(threads["tokenize"]) >= 2 and len(threads["compile"]) >= 2  # prepared, then found compiled on the take
    assert "llamabatch-engine" not in threads["tokenize"]
    assert threads["compile"].count("llamabatch-engine") == 1  # the take's lookup, a cache hit
    # the same refusal as before, now before the engine sees the request
    refused = httpx.post(f"{base}/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2, "grammar": "root ::= ("}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["message"].startswith("invalid grammar")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_metrics_count_an_answer_given_whole_at_its_end_and_only_a_streams_gaps(serve, stream):
    """Tokens of an answer given whole send no events: /metrics counts them, and its first
    token, from its result as it ends (as llama-server counts each request's tokens when its
    slot is reset); the inter-token histogram holds only the gaps a streaming client sees."""
    base = serve(n_parallel=1)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(model="tiny", prompt="hello world", max_tokens=24, temperature=0, stream=stream,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in reply if c.choices) if stream else reply.choices[0].text
    # (the metrics take a step's report just after its events are handed to the client)
    assert wait_for(lambda: count(base, "llamabatch_generated_tokens_total") == 24, 2)
    assert count(base, "llamabatch_time_to_first_token_seconds_count") == 1
    assert count(base, "llamabatch_inter_token_latency_seconds_count") == (23 if stream else 0)


def test_metrics_parse_as_prometheus_reads_them_with_counters_as_counters_and_a_model_on_every_series(serve):
    """/metrics through prometheus_client's own text parser: running totals are counters (so
    rate() reads them right), every engine series is labelled by its model, and the inter-token
    histogram counts the gaps of a streamed answer."""
    from prometheus_client.parser import text_string_to_metric_families

    base = serve(engine_extra={"speculative": "ngram"})
    body = {"prompt": "hello world hello world hello world", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and list(response.iter_lines())[-2] == "data: [DONE]"
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)}
    for name in ("llamabatch_draft_tokens", "llamabatch_draft_tokens_accepted", "llamabatch_priority_preemptions",
                 "llamabatch_adapter_switches", "llamabatch_checkpoint_restores", "llamabatch_generated_tokens",
                 "llamabatch_requests_finished"):
        assert families[name].type == "counter", name
    for name in ("llamabatch_kv_cells_used", "llamabatch_sequences_running", "llamabatch_checkpoint_bytes"):
        assert families[name].type == "gauge", name
    for family in families.values():
        if family.name.startswith("llamabatch_"):
            assert all("model" in sample.labels for sample in family.samples), family.name
    gaps = families["llamabatch_inter_token_latency_seconds"]
    assert gaps.type == "histogram"
    count = next(s for s in gaps.samples if s.name.endswith("_count"))
    assert count.labels["model"] and count.value >= 23
