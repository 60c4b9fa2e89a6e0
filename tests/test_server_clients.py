"""What evaluation harnesses and the official SDKs send: echo and prompt log-probabilities,
max_tokens 0, content parts, max_completion_tokens, stream_options, roles, the tokenizer
endpoints, and an OpenAPI document that declares every answer. Tiny model, 127.0.0.1."""

from __future__ import annotations

import httpx
import pytest

from llamabatch import BatchEngine

from reference import reference_prompt_logprobs


@pytest.fixture(scope="module")
def tokens(tiny_model) -> list[list[int]]:
    with BatchEngine(tiny_model, n_parallel=1, n_ctx=512) as engine:
        return [engine.vocab.tokenize(t, add_special=False) for t in ("the capital of France is Paris", "Once upon a time")]


def test_the_lm_eval_request_scores_every_prompt_token(client, tokens, tiny_model):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, one token, logprobs 1."""
    reply = client.completions.create(model="tiny", prompt=tokens, max_tokens=1, echo=True, logprobs=1, temperature=0, seed=1234)
    choices = sorted(reply.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1]
    for choice, prompt in zip(choices, tokens):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = reference_prompt_logprobs(tiny_model, prompt)
        assert lp.token_logprobs[1 : len(prompt)] == pytest.approx([v for v, _ in expected], abs=1e-4)
        for value, top, (_, greedy) in zip(lp.token_logprobs[1 : len(prompt)], lp.top_logprobs[1 : len(prompt)], expected):
            assert len(top) == 1 and (value == max(top.values())) == greedy  # lm-eval's is_greedy test
        assert lp.tokens[-1] and lp.token_logprobs[-1] <= 0  # then the generated token
        assert choice.text.startswith(lp.tokens[0] + lp.tokens[1])  # echo: the prompt's text comes first
    assert reply.usage.completion_tokens == 2


def test_max_tokens_0_echo_scores_the_prompt_only(client, base, tokens, tiny_model):
    reply = client.completions.create(model="tiny", prompt=tokens[0], max_tokens=0, echo=True, logprobs=0)
    choice = reply.choices[0]
    assert len(choice.logprobs.token_logprobs) == len(tokens[0]) and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0
    total = sum(v for v, _ in reference_prompt_logprobs(tiny_model, tokens[0]))
    assert sum(choice.logprobs.token_logprobs[1:]) == pytest.approx(total, abs=1e-3)
    nothing = httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 0}, timeout=10).json()
    assert nothing["choices"][0]["text"] == "" and nothing["usage"]["completion_tokens"] == 0
    one = client.completions.create(model="tiny", prompt=[tokens[0][0]], max_tokens=0, echo=True, logprobs=1)
    assert one.choices[0].logprobs.token_logprobs == [None]


def test_vllm_prompt_logprobs_for_completions_and_chat(base, tokens, tiny_model):
    body = {"prompt": tokens[1], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    choice = httpx.post(f"{base}/v1/completions", json=body, timeout=10).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(tokens[1])
    expected = reference_prompt_logprobs(tiny_model, tokens[1])
    for entry, token, (value, _) in zip(entries[1:], tokens[1][1:], expected):
        assert entry[str(token)]["logprob"] == pytest.approx(value, abs=1e-4)
        assert {e["rank"] for e in entry.values()} >= {1, 2} and all(e["decoded_token"] is not None for e in entry.values())
    chat = httpx.post(f"{base}/v1/chat/completions", timeout=10, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_chat_content_parts_roles_and_max_completion_tokens(client, base):
    as_string = client.chat.completions.create(
        model="tiny", messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hello\nworld"}],
        max_tokens=5, temperature=0)
    as_parts = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                                {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}],
        max_tokens=5, temperature=0)
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content  # developer reads as system
    long = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 40  # not max_tokens' default of 16
    image = httpx.post(f"{base}/v1/chat/completions", timeout=10, json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    assert image.status_code == 400
    assert "remote image URLs are not fetched here" in image.json()["error"]["message"]
    inline = httpx.post(f"{base}/v1/chat/completions", timeout=10, json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]})
    assert inline.status_code == 400 and "images and audio need --mmproj" in inline.json()["error"]["message"]  # a model without a projector
    audio = httpx.post(f"{base}/v1/chat/completions", timeout=10, json={"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]})
    assert audio.status_code == 400 and "content part 0: input_audio.data: must be the clip's file in base64" in audio.json()["error"]["message"]
    video = httpx.post(f"{base}/v1/chat/completions", timeout=10, json={"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]})
    assert video.status_code == 400 and "only text, image_url and input_audio parts are supported" in video.json()["error"]["message"]
    wizard = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "hi"}]}, timeout=10)
    assert wizard.status_code == 400 and "messages.0.role" in wizard.json()["error"]["message"]


def test_chat_stream_usage_only_when_asked(client):
    settings = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
                    extra_body={"ignore_eos": True}, stream=True)
    asked = list(client.chat.completions.create(stream_options={"include_usage": True}, **settings))
    assert asked[-1].usage.completion_tokens == 6 and asked[-1].choices == []
    assert all(c.usage is None for c in list(client.chat.completions.create(**settings)))


def test_streamed_echo_sends_the_prompt_first(client, tokens):
    chunks = list(client.completions.create(model="tiny", prompt=tokens[1], max_tokens=3, temperature=0, echo=True,
                                            logprobs=0, stream=True, extra_body={"ignore_eos": True}))
    whole = client.completions.create(model="tiny", prompt=tokens[1], max_tokens=3, temperature=0, echo=True, logprobs=0,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None  # the prompt's, first of them null


def test_tokenizer_endpoints_in_vllm_and_llama_server_shapes(base, tiny_model):
    with BatchEngine(tiny_model, n_parallel=1, n_ctx=512) as engine:
        expected = engine.vocab.tokenize("hello world")
        bare = engine.vocab.tokenize("hello world", add_special=False)
        eos = engine.vocab.eos
    vllm = httpx.post(f"{base}/tokenize", json={"prompt": "hello world"}).json()
    assert vllm["tokens"] == expected and vllm["count"] == len(expected) and vllm["max_model_len"] == 2048  # unified: all of it
    assert httpx.post(f"{base}/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()["tokens"] == bare
    assert httpx.post(f"{base}/tokenize", json={"content": "hello world"}).json()["tokens"] == bare  # llama-server's default
    text = httpx.post(f"{base}/detokenize", json={"tokens": bare}).json()
    assert text["prompt"] == text["content"] and text["prompt"].strip() == "hello world"
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    info = httpx.get(f"{base}/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and "im_start" in info["chat_template"]
    assert httpx.post(f"{base}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"] == [eos]
    card = httpx.get(f"{base}/v1/models").json()["data"][0]
    assert card["max_model_len"] == 2048


def test_lm_eval_finds_the_remote_tokenizer(base):
    utils = pytest.importorskip("lm_eval.utils")
    assert utils.check_remote_tokenizer_support(f"{base}/v1/completions")


def test_the_openapi_document_declares_every_answer(base):
    doc = httpx.get(f"{base}/openapi.json").json()
    for path, methods in doc["paths"].items():
        for method, operation in methods.items():
            assert "422" not in operation["responses"], (path, method)  # invalid requests get 400 here
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "429", "503", "504"} <= set(completions)
    assert "text/event-stream" in completions["200"]["content"]
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    prompt = doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert prompt[2]["items"]["maximum"] == 289 and prompt[2]["maxItems"] == 2048  # the served model's bounds
