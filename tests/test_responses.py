"""OpenAI's Responses API on `serve`, asked through the official `openai` client's `responses`,
unmodified: text, function tools and calls, streaming events, a conversation continued by
previous_response_id from the server's store, retrieval and deletion, structured output, thinking."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest

from test_chat import ASK, QWEN25, R1, TOOLS
from tiny_model import real_template, real_templates_kept, write_tiny_model

pytestmark = pytest.mark.skipif(not real_templates_kept(), reason="llama.cpp's templates not kept (scripts/build_native.sh; CI runs it)")

FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS]
QUESTION = ASK[0]["content"]


@pytest.fixture(scope="module")
def clients(serve, tmp_path_factory):
    folder = tmp_path_factory.mktemp("responses-models")
    bases = {"chatml": serve(n_parallel=2, n_ctx=8192, data_dir=folder / "data-chatml")}
    for name in (QWEN25, R1):
        (folder / name).mkdir()
        model = write_tiny_model(folder / name / "tiny.gguf", chat_template=real_template(name))
        bases[name] = serve(n_parallel=2, n_ctx=8192, model=model, data_dir=folder / f"data-{name}")
    return {name: openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0) for name, base in bases.items()}


def test_text_whole_and_streamed(clients):
    client = clients["chatml"]
    whole = client.responses.create(model="tiny", input=QUESTION, instructions="Be brief.", max_output_tokens=10, temperature=0)
    assert whole.object == "response" and whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in whole.output] == ["message"] and whole.output_text
    assert whole.usage.output_tokens == 10 and whole.usage.total_tokens == whole.usage.input_tokens + 10
    events = list(client.responses.create(model="tiny", input=QUESTION, instructions="Be brief.", max_output_tokens=10, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text


def test_function_calls_validate_whole_and_streamed(clients):
    for family in (QWEN25, "chatml"):
        client = clients[family]
        asked = dict(model="tiny", input=QUESTION, tools=FUNCTIONS, tool_choice="required", parallel_tool_calls=False,
                     temperature=0, max_output_tokens=120)
        whole = client.responses.create(**asked)
        calls = [item for item in whole.output if item.type == "function_call"]
        assert whole.status == "completed" and len(calls) == 1
        schema = {t["name"]: t["parameters"] for t in FUNCTIONS}[calls[0].name]
        jsonschema.validate(json.loads(calls[0].arguments), schema)
        with client.responses.stream(**asked) as stream:
            final = stream.get_final_response()
        assert [(i.name, json.loads(i.arguments)) for i in final.output if i.type == "function_call"] == [
            (calls[0].name, json.loads(calls[0].arguments))]
        named = client.responses.create(**{**asked, "tool_choice": {"type": "function", "name": "get_time"}})
        assert [i.name for i in named.output if i.type == "function_call"] == ["get_time"]


def test_a_conversation_continues_from_a_stored_response(clients):
    """previous_response_id: the stored conversation (the call included) is continued with the
    tool's output; the earlier instructions are not carried over, as OpenAI documents."""
    client = clients[QWEN25]
    first = client.responses.create(model="tiny", input=QUESTION, instructions="You are a weather bot. " * 20, tools=FUNCTIONS,
                                    tool_choice="required", parallel_tool_calls=False, temperature=0, max_output_tokens=120)
    call = next(item for item in first.output if item.type == "function_call")
    second = client.responses.create(model="tiny", previous_response_id=first.id, tools=FUNCTIONS, tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "14 C, rain"}],
                                     max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id and second.output_text
    alone = client.responses.create(model="tiny", tools=FUNCTIONS, tool_choice="none", max_output_tokens=4, temperature=0,
                                    input=[{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
                                           {"type": "function_call_output", "call_id": call.call_id, "output": "14 C, rain"}])
    assert second.usage.input_tokens == alone.usage.input_tokens  # the same conversation, without the instructions
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_stored_responses_are_kept_and_deleted(clients):
    client = clients["chatml"]
    kept = client.responses.create(model="tiny", input="hello", max_output_tokens=2)
    assert client.responses.retrieve(kept.id).id == kept.id
    deleted = client.responses.delete(kept.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError, match="no response with id"):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError, match="no response with id"):
        client.responses.create(model="tiny", input="hello", previous_response_id=kept.id)
    unkept = client.responses.create(model="tiny", input="hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_structured_output_and_thinking(clients):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    shaped = clients["chatml"].responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=40,
                                                text={"format": {"type": "json_schema", "name": "ok", "schema": schema}})
    jsonschema.validate(json.loads(shaped.output_text), schema)
    thought = clients[R1].responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=16)
    assert [item.type for item in thought.output] == ["reasoning"] and thought.output[0].content[0].text
    plain = clients[R1].responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=16, reasoning={"effort": "none"})
    assert [item.type for item in plain.output] == ["message"]


def test_bad_requests_are_400s(clients):
    client = clients["chatml"]
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.responses.create(model="tiny", input="hi", tools=FUNCTIONS, tool_choice={"type": "function", "name": "nope"})
    with pytest.raises(openai.BadRequestError, match="unknown field 'conversation'"):
        client.responses.create(model="tiny", input="hi", extra_body={"conversation": "conv_1"})
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        client.responses.create(model="gpt-elsewhere", input="hi")
    with pytest.raises(openai.BadRequestError, match="the chat request this one means is invalid: messages"):  # a thought alone is no conversation
        client.responses.create(model="tiny", input=[{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]}])


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_the_agents_sdk_runs_a_two_tool_loop_over_either_api(clients, api):
    """OpenAI's Agents SDK, unmodified, over the Responses API (its default) and over Chat
    Completions: its first turn must call get_weather, then (switched by its own hook) get_time,
    whose result ends the run."""
    import asyncio

    from agents import (
        Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, RunHooks, Runner, StopAtTools, function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    ran: list[tuple[str, dict]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"], days: int) -> str:
        """The weather in a city for some days."""
        ran.append(("get_weather", {"city": city, "days": days}))
        return f"rain in {city} for {days} days"

    @function_tool
    def get_time(tz: Literal["UTC", "CET"]) -> str:
        """The time now in a time zone."""
        ran.append(("get_time", {"tz": tz}))
        return f"12:00 {tz}"

    class Next(RunHooks):
        async def on_tool_end(self, context, agent, tool, result):
            agent.model_settings = ModelSettings(tool_choice="get_time", temperature=0, parallel_tool_calls=False)

    client = openai.AsyncOpenAI(base_url=str(clients[QWEN25].base_url), api_key="none", max_retries=0)
    model_kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(
        name="weather", instructions="Use the tools.", tools=[get_weather, get_time],
        model=model_kind(model="tiny", openai_client=client),
        model_settings=ModelSettings(tool_choice="get_weather", temperature=0, parallel_tool_calls=False, max_tokens=120),
        tool_use_behavior=StopAtTools(stop_at_tool_names=["get_time"]), reset_tool_choice=False,
    )
    result = asyncio.run(Runner.run(agent, "Weather in Paris, and the time?", hooks=Next(), max_turns=4))
    assert [name for name, _ in ran] == ["get_weather", "get_time"]
    assert result.final_output == f"12:00 {ran[1][1]['tz']}"
