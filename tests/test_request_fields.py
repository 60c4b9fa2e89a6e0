"""One policy for request fields in the server and in job files: what is declared works
(logit_bias, repetition_penalty / repeat_penalty, user), anything else is a 400 naming it;
OpenAI's defaults where OpenAI's shapes enter; a request no queue could hold is a 400."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from llamabatch import BatchEngine, SamplingParams
from llamabatch.jobs import BatchJob

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def a_token(base: str) -> tuple[int, str]:
    """A token id of the served vocabulary, and its text (asked of the server)."""
    token = httpx.post(f"{base}/tokenize", json={"prompt": "then", "add_special_tokens": False}).json()["tokens"][-1]
    return token, httpx.post(f"{base}/detokenize", json={"tokens": [token]}).json()["prompt"]


def test_an_unknown_field_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError, match="unknown field 'best_of': llamabatch does not support it"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=2, extra_body={"best_of": 2})
    functions = [{"name": "f", "parameters": {"type": "object"}}]  # the API's older form of tools
    with pytest.raises(openai.BadRequestError, match="unknown field 'functions'"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, functions=functions)
    with pytest.raises(openai.BadRequestError, match="unknown field 'response_format.strictness'"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"response_format": {"type": "json_object", "strictness": 1}})


def test_an_earlier_answer_sent_back_in_the_messages_is_accepted(client):
    """The official client's own assistant message, appended as is (its empty tool fields included)."""
    messages = [{"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, **GREEDY)
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "and?"}]
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, **GREEDY)
    assert again.usage.completion_tokens == 3


def test_the_same_unknown_field_fails_the_same_way_in_a_batch_job(base, make_engine, tmp_path):
    body = {"prompt": "hello", "max_tokens": 2, "best_of": 2}
    served = httpx.post(f"{base}/v1/completions", json=body)
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": body}) + "\n"
                      + json.dumps({"custom_id": "y", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}) + "\n")
    summary = BatchJob(make_engine(), source, tmp_path / "out.jsonl").run()
    assert (summary.done, summary.failed) == (1, 1)
    error = json.loads((tmp_path / "out.jsonl.errors.jsonl").read_text())
    assert (error["response"]["status_code"], error["response"]["body"]) == (400, served.json())
    jsonl = tmp_path / "in2.jsonl"
    jsonl.write_text(json.dumps({"prompt": "hello", "best_of": 2}) + "\n")
    BatchJob(make_engine(), jsonl, tmp_path / "out2.jsonl").run()
    line = json.loads((tmp_path / "out2.jsonl.errors.jsonl").read_text())
    assert line["error"]["message"] == "unknown field 'best_of': llamabatch does not support it"


def test_logit_bias_is_honoured(base, client):
    token, text = a_token(base)
    forced = client.completions.create(model="tiny", prompt="hello", max_tokens=5, logit_bias={str(token): 100}, **GREEDY)
    assert forced.choices[0].text == text * 5
    plain = client.completions.create(model="tiny", prompt="hello", max_tokens=3, **GREEDY)
    unforced = client.completions.create(model="tiny", prompt="hello", max_tokens=3, logit_bias={str(token): 0}, **GREEDY)
    assert unforced.choices[0].text == plain.choices[0].text  # a zero bias changes nothing
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=1, logit_bias={"999999": 5})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=1, logit_bias={str(token): 101})


def test_repetition_penalty_in_vllm_and_llama_server_spelling(client, tiny_model):
    with BatchEngine(tiny_model, n_parallel=1, n_threads=2) as engine:
        expected = engine.generate(["abc abc abc"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                   repeat_penalty=1.5))[0].text
    for name in ("repetition_penalty", "repeat_penalty"):
        reply = client.completions.create(model="tiny", prompt="abc abc abc", max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True, name: 1.5})
        assert reply.choices[0].text == expected
    with pytest.raises(openai.BadRequestError, match="one setting"):
        client.completions.create(model="tiny", prompt="x", max_tokens=1,
                                  extra_body={"repetition_penalty": 1.5, "repeat_penalty": 1.2})


def test_user_is_accepted(client):
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2, user="someone").usage.completion_tokens >= 1


def test_the_openapi_document_lists_exactly_what_is_accepted(base):
    schemas = httpx.get(f"{base}/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatRequest", "ChatMessage", "ResponseFormat"):
        assert schemas[name]["additionalProperties"] is False, name
    assert {"logit_bias", "repetition_penalty", "repeat_penalty", "user"} <= set(schemas["CompletionRequest"]["properties"])


def test_a_chat_answer_without_a_limit_runs_to_the_context(serve):
    """OpenAI's chat has no 16-token default: an answer runs until it ends or the context is full."""
    base = serve(n_parallel=1, n_ctx=256)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **GREEDY)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens > 16 and reply.usage.total_tokens in (256, 257)  # the last one is never decoded
    completion = client.completions.create(model="tiny", prompt="hi", **GREEDY)
    assert completion.usage.completion_tokens == 16  # OpenAI's completions default stays


def test_a_request_no_queue_could_hold_is_400_not_429(serve):
    base = serve(n_parallel=1, max_queue=4)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError, match=r"asks for 6 sequences .* queues at most 4"):
        client.completions.create(model="tiny", prompt=["a", "b", "c"], n=2, max_tokens=2)
    assert client.completions.create(model="tiny", prompt=["a", "b"], n=2, max_tokens=2).usage.completion_tokens >= 4
