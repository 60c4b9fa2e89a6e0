"""Anthropic's Messages API on `serve`, asked through the official `anthropic` client, unmodified:
text, stop sequences, tools (tool_use and tool_result blocks), thinking, streaming events, token
counting and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from test_chat import ASK, QWEN25, R1, TOOLS
from tiny_model import real_template, real_templates_kept, write_tiny_model

pytestmark = pytest.mark.skipif(not real_templates_kept(), reason="llama.cpp's templates not kept (scripts/build_native.sh; CI runs it)")

GREEDY = {"temperature": 0}  # the current client has no sampling arguments; the API still takes them
WEATHER = {"name": "get_weather", "description": TOOLS[0]["function"]["description"], "input_schema": TOOLS[0]["function"]["parameters"]}
TIME = {"name": "get_time", "description": TOOLS[1]["function"]["description"], "input_schema": TOOLS[1]["function"]["parameters"]}


@pytest.fixture(scope="module")
def bases(serve, tmp_path_factory):
    folder = tmp_path_factory.mktemp("anthropic-models")
    out = {"chatml": serve(n_parallel=2, n_ctx=8192)}
    for name in (QWEN25, R1):
        (folder / name).mkdir()
        out[name] = serve(n_parallel=2, n_ctx=8192, model=write_tiny_model(folder / name / "tiny.gguf", chat_template=real_template(name)))
    return out


@pytest.fixture(scope="module")
def clients(bases):
    return {name: anthropic.Anthropic(base_url=base, api_key="none", max_retries=0) for name, base in bases.items()}


def test_a_message_answers_in_anthropics_shape_with_its_usage(clients):
    client = clients["chatml"]
    asked = dict(model="tiny", max_tokens=12, extra_body=GREEDY, system="Be brief.", messages=ASK)
    counted = client.messages.count_tokens(model="tiny", system="Be brief.", messages=ASK).input_tokens
    reply = client.messages.create(**asked)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text
    assert reply.usage.output_tokens == 12
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted


def test_a_stop_sequence_is_named_when_it_ends_the_answer(clients):
    client = clients["chatml"]
    asked = dict(model="tiny", max_tokens=24, extra_body=GREEDY, messages=ASK)
    text = client.messages.create(**asked).content[0].text
    stop = text[8:11]
    assert stop and stop not in text[:8]
    reply = client.messages.create(**asked, stop_sequences=[stop, "never there"])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("family", [QWEN25, "chatml"])
def test_tools_answer_with_tool_use_blocks_and_take_results_back(clients, family):
    client = clients[family]
    reply = client.messages.create(model="tiny", max_tokens=120, extra_body=GREEDY, messages=ASK, tools=[WEATHER, TIME],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert reply.stop_reason == "tool_use"
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert len(uses) == 1
    schema = {"get_weather": WEATHER, "get_time": TIME}[uses[0].name]["input_schema"]
    jsonschema.validate(uses[0].input, schema)
    named = client.messages.create(model="tiny", max_tokens=120, extra_body=GREEDY, messages=ASK, tools=[WEATHER, TIME],
                                   tool_choice={"type": "tool", "name": "get_time"})
    assert [b.name for b in named.content if b.type == "tool_use"][:1] == ["get_time"]
    follow = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "14 C, rain"}]}]
    after = client.messages.create(model="tiny", max_tokens=8, messages=follow, tools=[WEATHER, TIME], tool_choice={"type": "none"})
    assert after.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in after.content)


def test_a_streamed_message_is_the_whole_one(clients):
    """The client's own stream helper assembles Anthropic's events into the same message."""
    for family, extra in ((QWEN25, dict(tools=[WEATHER, TIME], tool_choice={"type": "any", "disable_parallel_tool_use": True})),
                          ("chatml", {})):
        client = clients[family]
        asked = dict(model="tiny", max_tokens=60, extra_body=GREEDY, messages=ASK, **extra)
        whole = client.messages.create(**asked)
        with client.messages.stream(**asked) as stream:
            streamed = stream.get_final_message()
        assert streamed.stop_reason == whole.stop_reason
        shape = lambda m: [(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None)) for b in m.content]  # noqa: E731
        assert shape(streamed) == shape(whole)


def test_thinking_comes_as_its_own_block_within_its_budget(clients):
    client = clients[R1]
    thought = client.messages.create(model="tiny", max_tokens=40, extra_body=GREEDY, messages=ASK,
                                     thinking={"type": "enabled", "budget_tokens": 4})
    assert [b.type for b in thought.content] == ["thinking", "text"]
    with client.messages.stream(model="tiny", max_tokens=40, extra_body=GREEDY, messages=ASK,
                                thinking={"type": "enabled", "budget_tokens": 4}) as stream:
        assert [b.type for b in stream.get_final_message().content] == ["thinking", "text"]
    plain = client.messages.create(model="tiny", max_tokens=12, extra_body=GREEDY, messages=ASK, thinking={"type": "disabled"})
    assert [b.type for b in plain.content] == ["text"]


def test_errors_come_in_anthropics_shape(clients, bases):
    client = clients["chatml"]
    with pytest.raises(anthropic.NotFoundError, match="does not exist here"):
        client.messages.create(model="claude-elsewhere", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        client.messages.create(model="tiny", max_tokens=4, messages=ASK, tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"})
    answer = httpx.post(f"{bases['chatml']}/v1/messages", json={"model": "tiny", "messages": ASK})  # no max_tokens
    assert answer.status_code == 400
    assert answer.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}}
    server_tool = {"type": "web_search_20250305", "name": "web_search"}
    assert httpx.post(f"{bases['chatml']}/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": ASK,
                                                              "tools": [server_tool]}).status_code == 400
    assert json.loads(httpx.get(f"{bases['chatml']}/health").text) == {"status": "ok"}
