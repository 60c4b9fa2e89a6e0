"""Chat templates as models ship them (Jinja), tool calls and reasoning: tiny GGUFs that carry real
templates of several families (from llama.cpp's collection, kept by scripts/build_native.sh),
served, and asked through the official openai client."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest

from llamabatch.chat import ChatTemplate, Reasoning, ToolFormat, Tools
from llamabatch.chat.conversation import Answer
from llamabatch.engine import BatchEngine, SamplingParams
from llamabatch.chat.reasoning import ThinkingBudget

from tiny_model import real_template, real_templates_folder, real_templates_kept, write_tiny_model

pytestmark = pytest.mark.skipif(not real_templates_kept(), reason="llama.cpp's templates not kept (scripts/build_native.sh; CI runs it)")
COLLECTION = sorted(path.stem for path in real_templates_folder().glob("*.jinja")) if real_templates_kept() else []


@pytest.mark.parametrize("name", COLLECTION)
def test_every_template_of_the_collection_renders_a_conversation_with_a_system_message(name):
    """Each of llama.cpp's 70 templates renders what a client sends (Hugging Face's `generation`
    block, tools left undefined when there are none, firefunction's `functions`), every message's
    text in the prompt; one without a system role gets the system text folded into the first
    user message, as llama.cpp folds it."""
    template = ChatTemplate(real_template(name), name, "<s>", "</s>")
    messages = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "What is the capital?"},
                {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Spain?"}]
    text = template.render(messages)
    assert all(part in text for part in ("Answer in French.", "What is the capital?", "And of Spain?")), text
    if not template.has_system_role:
        assert "Answer in French.\nWhat is the capital?" in text

QWEN25 = "Qwen-Qwen2.5-7B-Instruct"
HERMES3 = "NousResearch-Hermes-3-Llama-3.1-8B-tool_use"
QWEN3 = "Qwen-Qwen3-0.6B"
LLAMA31 = "meta-llama-Llama-3.1-8B-Instruct"
LLAMA33 = "meta-llama-Llama-3.3-70B-Instruct"
MISTRAL = "mistralai-Mistral-Nemo-Instruct-2407"
R1 = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"
QWEN3_CODER = "Qwen3-Coder"
GLM = "GLM-4.6"
KIMI = "Kimi-K2-Instruct"
DEEPSEEK = "deepseek-ai-DeepSeek-V3.1"
DSML = "deepseek-ai-DeepSeek-V3.2"
COMMAND_R = "CohereForAI-c4ai-command-r7b-12-2024-tool_use"
MINIMAX = "MiniMax-M2"

# A thinking template's random model would think until max_tokens: four tokens of thought, then its calls.
# Markers that are control tokens in their models' vocabularies (and could not be written as text
# by the tiny model's: its tokenizer reads "▁" as a blank)
CONTROLS = ("<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581sep\uff5c>",
            "<\uff5ctool\u2581call\u2581end\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>")

SHORT_THOUGHT = {"reasoning_budget": 4}
# Closed values (enums, bounded integers) so that a random model's call ends within a few tokens.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"], "description": "City"},
                                                     "days": {"type": "integer", "minimum": 1, "maximum": 7, "description": "Days ahead"}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"], "description": "Time zone"}},
                                       "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]


def assert_valid(calls) -> None:
    """Every call names a given tool, and its arguments parse and validate against that tool's schema."""
    assert calls
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


# -- templates and the families' formats, without a model ------------------------------------


@pytest.mark.parametrize("name, family", [
    (QWEN25, "hermes"), (HERMES3, "hermes"), (QWEN3, "hermes"), (LLAMA31, "llama3"), (LLAMA33, "llama3"), (MISTRAL, "mistral"),
    (QWEN3_CODER, "qwen3-coder"), (GLM, "glm"),
])
def test_each_family_reads_back_the_calls_its_own_template_writes(name, family):
    """An assistant turn with a call, rendered by the model's template, parses back into that
    call: the parser reads what the model was trained to write."""
    source = real_template(name)
    template = ChatTemplate(source, name, bos_token="<s>", eos_token="</s>")
    format = ToolFormat.detect(source)
    assert format.name == family
    call = {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}
    before = template.render(ASK, tools=TOOLS, add_generation_prompt=True)
    after = template.render([*ASK, {"role": "assistant", "content": "", "tool_calls": [call]}], tools=TOOLS, add_generation_prompt=False)
    assert after.startswith(before)
    written = after[len(before):]
    reasoning = Reasoning.of(source, before)
    content, calls = format.parse(reasoning.split(written)[1] if reasoning else written, Tools.of(TOOLS, "auto", True))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo", "days": 2})]
    assert content.strip() == ""


@pytest.mark.parametrize("name", [QWEN3_CODER, GLM])
def test_xml_calls_read_back_strings_as_written_and_other_values_as_json(name):
    """Qwen3-Coder's and GLM's XML carry strings raw (newlines and all) and other values as their
    templates write them (Python's True, JSON for lists): read back by the tool's schema."""
    note = {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
        "text": {"type": "string"}, "done": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}},
        "count": {"type": "string"}}}}}
    arguments = {"text": "two\nlines", "done": True, "tags": ["a", "b"], "count": "3"}
    template = ChatTemplate(real_template(name), name)
    call = {"id": "c1", "type": "function", "function": {"name": "note", "arguments": arguments}}
    before = template.render(ASK, tools=[note], add_generation_prompt=True)
    written = template.render([*ASK, {"role": "assistant", "content": "", "tool_calls": [call]}], tools=[note],
                              add_generation_prompt=False)[len(before):]
    reasoning = Reasoning.of(template.source, before)
    written = reasoning.split(written)[1] if reasoning else written
    _, calls = ToolFormat.detect(template.source).parse(written, Tools.of([note], "auto", True))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("note", arguments)]


def test_templates_without_tool_markup_get_the_generic_form():
    assert ToolFormat.detect("{% for m in messages %}{{ m.content }}{% endfor %}").name == "generic"
    assert ToolFormat.detect(real_template("google-gemma-2-2b-it")).name == "generic"


def test_templates_get_what_hugging_face_gives_them():
    """raise_exception stops a render with the template's message; tojson keeps Unicode and
    does not escape HTML; strftime_now is there (Llama 3.2 dates its system prompt with it)."""
    from llamabatch.errors import ChatTemplateError

    mistral = ChatTemplate(real_template(MISTRAL), MISTRAL)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        mistral.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    rendered = ChatTemplate("{{ messages[0] | tojson }}", "test").render([{"role": "user", "content": "Zürich <b>"}])
    assert json.loads(rendered)["content"] == "Zürich <b>" and "<b>" in rendered
    assert "Today Date:" in ChatTemplate(real_template("meta-llama-Llama-3.2-3B-Instruct"), "3.2").render(ASK)


def test_reasoning_splits_the_same_whole_or_in_any_pieces():
    text = "<think>\nFirst, Paris.\n</think>\n\nIt rains."
    whole = Reasoning().split(text)
    assert whole == ("\nFirst, Paris.\n", "It rains.")
    for size in (1, 2, 3, 7):
        stream = Reasoning().streamed()
        pieces = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)] + [stream.feed("", final=True)]
        assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == whole
    assert Reasoning(open=True).split("still thinking") == ("still thinking", "")  # cut before it closed
    assert Reasoning().split("no thought at all") == ("", "no thought at all")


def test_a_streamed_answer_sends_prose_at_once_and_the_call_when_complete():
    format = ToolFormat.detect(real_template(QWEN25))
    answer = Answer(Tools.of(TOOLS, "auto", True), format)
    text = 'Let me look.\n<tool_call>\n{"name":"get_time","arguments":{"tz":"UTC"}}\n</tool_call>'
    stream = answer.stream()
    deltas = [d for i in range(0, len(text), 4) for d in stream.feed(text[i:i + 4])]
    assert "".join(d.get("content", "") for d in deltas) == "Let me look.\n"  # the marker was held back, never sent
    assert not any("tool_calls" in d for d in deltas)
    last = stream.feed("", final=True)
    assert last[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
    assert answer.message(text)["content"] == "Let me look.\n"  # whole: what the stream sent


# -- served ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-models")  # each served as "tiny", the name the requests give
    models = {}
    for name in (QWEN25, LLAMA31, MISTRAL, QWEN3, R1, QWEN3_CODER, GLM, KIMI, DEEPSEEK, DSML, COMMAND_R, MINIMAX):
        (folder / name).mkdir()
        controls = CONTROLS if name == DEEPSEEK else ()
        models[name] = write_tiny_model(folder / name / "tiny.gguf", chat_template=real_template(name), controls=controls)
    return models


@pytest.fixture(scope="module")
def clients(serve, family_models, tiny_model):
    """An openai client per template family (and the tiny model's plain ChatML: the generic form)."""
    bases = {name: serve(n_parallel=2, n_ctx=8192, model=path) for name, path in family_models.items()}
    bases["chatml"] = serve(n_parallel=2, n_ctx=8192)
    return {name: openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0) for name, base in bases.items()}


@pytest.mark.parametrize("family", [QWEN25, LLAMA31, MISTRAL, QWEN3_CODER, GLM, KIMI, DEEPSEEK, DSML, COMMAND_R, MINIMAX, "chatml"])
def test_required_and_named_tool_choices_return_calls_that_validate(clients, family):
    client = clients[family]
    for choice, name in (("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")):
        # (DeepSeek's XML markup takes the tiny model, a token a character, near 200 tokens a call)
        reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                               parallel_tool_calls=False, temperature=0, max_tokens=400, extra_body=SHORT_THOUGHT)
        choice0 = reply.choices[0]
        assert choice0.finish_reason == "tool_calls"
        assert_valid(choice0.message.tool_calls)
        assert len(choice0.message.tool_calls) == 1
        assert name is None or choice0.message.tool_calls[0].function.name == name


@pytest.mark.parametrize("family", [QWEN25, MISTRAL, QWEN3_CODER, KIMI, DEEPSEEK, COMMAND_R, "chatml"])
def test_parallel_calls_all_validate(clients, family):
    reply = clients[family].chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                                    temperature=0, max_tokens=200, extra_body=SHORT_THOUGHT)
    calls = reply.choices[0].message.tool_calls
    assert_valid(calls)
    if reply.choices[0].finish_reason == "length":  # more calls kept coming: every complete one still validates
        assert len(calls) >= 1


@pytest.mark.parametrize("family", [QWEN25, LLAMA31, QWEN3_CODER, GLM, KIMI, DEEPSEEK, DSML, COMMAND_R, MINIMAX, "chatml"])
def test_streamed_calls_arrive_in_openais_delta_shape_and_match_the_whole_answer(clients, family):
    client = clients[family]
    asked = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=400,
                 extra_body=SHORT_THOUGHT)
    whole = client.chat.completions.create(**asked).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    content = ""
    for chunk in client.chat.completions.create(**asked, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():  # accumulated as OpenAI's clients do
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
    ]
    assert all(c["id"] for c in calls.values())


def test_auto_answers_in_text_or_with_calls_that_validate(clients):
    for family in (QWEN25, LLAMA31, "chatml"):
        reply = clients[family].chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0.7, seed=1, max_tokens=60)
        message = reply.choices[0].message
        if message.tool_calls:
            assert_valid(message.tool_calls)
        else:
            assert "<tool_call>" not in (message.content or "") or reply.choices[0].finish_reason == "length"


def test_a_conversation_carries_calls_and_their_results_back(clients):
    """The client appends the assistant's calls and the tools' results, and the model goes on: every
    family's template renders them (Mistral's needs its nine-character ids, which it got)."""
    for family in (QWEN25, LLAMA31, MISTRAL, QWEN3_CODER, GLM, "chatml"):
        client = clients[family]
        first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                               temperature=0, max_tokens=200, extra_body=SHORT_THOUGHT).choices[0].message
        results = [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature_c": 14})} for c in first.tool_calls]
        messages = [*ASK, first.model_dump(exclude_none=True), *results]
        second = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8,
                                                extra_body=SHORT_THOUGHT)
        assert second.choices[0].finish_reason in ("stop", "length")
        assert second.choices[0].message.tool_calls is None


def test_thinking_comes_apart_from_the_answer(clients):
    """DeepSeek R1's template opens the thought in the prompt: a thought cut by max_tokens is all
    reasoning_content, whole or streamed (the same text); thinking turned off puts the answer in content."""
    client = clients[R1]
    asked = dict(model="tiny", messages=ASK, temperature=0, max_tokens=24)
    whole = client.chat.completions.create(**asked).choices[0].message
    thought = whole.model_extra["reasoning_content"]
    assert thought and whole.content == ""
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**asked, stream=True):
        for choice in chunk.choices:
            streamed["content"] += choice.delta.content or ""
            streamed["reasoning_content"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
    assert streamed == {"reasoning_content": thought, "content": ""}
    off = client.chat.completions.create(**asked, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert off.content and "reasoning_content" not in (off.model_extra or {})


def test_qwen3_thinks_unless_asked_not_to(make_engine, family_models):
    engine = make_engine(family_models[QWEN3])
    on = engine.chat_prompt(ASK)
    off = engine.chat_prompt(ASK, template_kwargs={"enable_thinking": False})
    assert on.answer.reasoning == Reasoning(open=False)
    assert off.text.endswith("<think>\n\n</think>\n\n") and off.answer.reasoning is None


def test_bad_tool_requests_are_400s_naming_the_problem(clients):
    client = clients[QWEN25]
    with pytest.raises(openai.BadRequestError, match="'get_date', which is not among the tools"):
        client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_date"}})
    with pytest.raises(openai.BadRequestError, match="tools and a response format"):
        client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model="tiny", messages=ASK, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="function names must be unique"):
        client.chat.completions.create(model="tiny", messages=ASK, tools=[TIME, TIME])
    with pytest.raises(openai.BadRequestError, match="roles must alternate"):  # Mistral's template refuses the messages
        clients[MISTRAL].chat.completions.create(model="tiny", messages=[*ASK, *ASK], max_tokens=2)


def test_a_batch_job_line_with_tools_gets_calls(tmp_path, family_models):
    """The same request as a job line: the output body is the server's, calls included."""
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 0, "max_tokens": 120}
    jobs = tmp_path / "in.jsonl"
    jobs.write_text(json.dumps({"custom_id": "w", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "llamabatch.cli", "batch", str(jobs), "-o", str(out), "-m", str(family_models[QWEN25]),
                           "--parallel", "2", "--ctx", "8192"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    choice = json.loads(out.read_text())["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]["function"]
    jsonschema.validate(json.loads(call["arguments"]), {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call["name"]])


def test_chat_template_override_from_a_file_or_a_built_in(tmp_path, serve, make_engine):
    """--chat-template replaces the GGUF's: a Jinja file (here Qwen 2.5's, whose tools then work in
    its family's form), or a llama.cpp built-in by name."""
    path = tmp_path / "qwen.jinja"
    path.write_text(real_template(QWEN25))
    base = serve(n_parallel=1, n_ctx=8192, engine_extra={"chat_template": str(path)})
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=200)
    assert_valid(reply.choices[0].message.tool_calls)
    assert "<tool_call>" in httpx.get(f"{base}/tokenizer_info").json()["chat_template"]
    assert "<|start_header_id|>user<|end_header_id|>" in make_engine(chat_template="llama3").chat_prompt(ASK).text
    from llamabatch.errors import ConfigError

    with pytest.raises(ConfigError, match="--chat-template nope: 'nope' is neither a Jinja file nor one of llama.cpp's built-in templates"):
        make_engine(chat_template="nope")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="does not parse"):
        make_engine(chat_template=str(tmp_path / "broken.jinja"))


def test_a_thinking_budget_closes_the_thought_and_the_answer_follows(clients, serve, family_models):
    """reasoning_budget N (llama-server's --reasoning-budget, per request): after N tokens of thought
    the close is written for the model, and it answers; without one, the thought takes every token.
    `serve --reasoning-budget` is the default of requests that give none; 0 turns thinking off."""
    client = clients[R1]
    asked = dict(model="tiny", messages=ASK, temperature=0, max_tokens=40)
    unlimited = client.chat.completions.create(**asked).choices[0].message
    assert unlimited.content == "" and unlimited.model_extra["reasoning_content"]
    budgeted = client.chat.completions.create(**asked, extra_body={"reasoning_budget": 4}).choices[0].message
    assert budgeted.content and budgeted.model_extra["reasoning_content"]
    base = serve(n_parallel=1, n_ctx=4096, model=family_models[R1], reasoning_budget=4)
    by_default = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0).chat.completions.create(**asked)
    assert by_default.choices[0].message.content and by_default.choices[0].message.model_extra["reasoning_content"]
    off = client.chat.completions.create(**asked, extra_body={"reasoning_budget": 0}).choices[0].message
    assert off.content and "reasoning_content" not in (off.model_extra or {})


@pytest.mark.parametrize("name", COLLECTION)
def test_a_thinking_budget_of_zero_leaves_no_thought_open_in_any_template(name, tiny_model):
    """Budget 0 in each template of the collection: the prompt closes any thought it opened (the
    templates that open one whatever enable_thinking says: DeepSeek R1's, MiniMax M2's, StepFun's,
    Nemotron Nano v2's), and a thought the model may still open is closed as it opens."""
    from llamabatch.chat.conversation import Chat

    with BatchEngine(tiny_model, n_parallel=1, n_ctx=256, n_threads=1) as engine:
        chat = Chat(ChatTemplate(real_template(name), name, "<s>", "</s>"), engine.vocab, None)
        prompt = chat.prompt([{"role": "user", "content": "Hi"}], reasoning_budget=0)
    reasoning = prompt.answer.reasoning
    assert reasoning is None or (not reasoning.open and prompt.thinking_budget == ThinkingBudget(0, markup=reasoning.markup))


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("collection") / "tiny.gguf", controls=CONTROLS)
    with BatchEngine(model, n_parallel=2, n_ctx=8192, n_threads=2) as engine:
        yield engine


BOUNDED = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"], "additionalProperties": False}


@pytest.mark.parametrize("name", COLLECTION)
def test_every_template_of_the_collection_writes_a_required_call_that_holds_to_a_bounded_schema(name, tiny_engine):
    """tool_choice required, one tool whose string is bounded (maxLength 10), thinking off (the
    tiny model never ends a thought): in each family's own form (JSON, or XML parameters whose
    raw strings are held to their bounds too) the call parses and validates."""
    from llamabatch.chat.conversation import Chat

    chat = Chat(ChatTemplate(real_template(name), name, "<s>", "</s>"), tiny_engine.vocab, None)
    tools = Tools.of([{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": BOUNDED}}],
                     "required", False)
    prompt = chat.prompt([{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"}], tools, None, 0)
    params = SamplingParams(max_tokens=200, temperature=0, lark=prompt.lark, thinking_budget=prompt.thinking_budget,
                            shown_tokens=prompt.shown_tokens)
    [result] = tiny_engine.generate([prompt.tokens], params)
    calls = prompt.answer.message(result.text).get("tool_calls") or []
    assert result.finish_reason == "stop" and len(calls) == 1, (result.finish_reason, result.text[-200:])
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), BOUNDED)


@pytest.mark.parametrize("name", COLLECTION)
def test_every_template_of_the_collection_carries_a_call_and_its_result_back(name, tiny_engine):
    """A conversation with an assistant's call (content null, as clients send it) and the tool's
    result renders in each template, the result and the call's argument in the prompt."""
    from llamabatch.chat.conversation import Chat

    chat = Chat(ChatTemplate(real_template(name), name, "<s>", "</s>"), tiny_engine.vocab, None)
    call = {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "abcDEF123", "content": "SUNNY-21C"}]
    tools = Tools.of([{"type": "function", "function": {"name": "get_weather", "parameters": BOUNDED}}], "auto", True)
    text = chat.prompt(messages, tools, None, 0).text
    assert "SUNNY-21C" in text and "Paris" in text


def test_the_guide_shows_the_collection_as_it_is_read():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    made = subprocess.run([sys.executable, str(root / "scripts" / "template_table.py")], capture_output=True, text=True, check=True)
    assert made.stdout.strip() in (root / "docs" / "guides" / "tool-calls.md").read_text(), "python scripts/template_table.py"


@pytest.mark.parametrize("name", ["Qwen3-Coder", "GLM-4.6"])
def test_xml_parameters_hold_patterns_consts_lengths_and_json_values(name, tiny_engine):
    """In the XML families a string is written raw between tags: its pattern, const and length
    bounds hold there as they do in JSON; other values are JSON."""
    from llamabatch.chat.conversation import Chat

    schema = {"type": "object", "additionalProperties": False, "required": ["code", "unit", "note", "days", "when"], "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"}, "unit": {"type": "string", "const": "celsius"},
        "note": {"type": "string", "minLength": 2, "maxLength": 6}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "when": {"type": "string", "format": "date"}}}
    chat = Chat(ChatTemplate(real_template(name), name, "<s>", "</s>"), tiny_engine.vocab, None)
    tools = Tools.of([{"type": "function", "function": {"name": "forecast", "parameters": schema}}], "required", False)
    prompt = chat.prompt([{"role": "user", "content": "Forecast?"}], tools, None, 0)
    [result] = tiny_engine.generate([prompt.tokens], SamplingParams(max_tokens=1000, temperature=0.8, seed=3, lark=prompt.lark))
    [call] = prompt.answer.message(result.text)["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, schema, format_checker=jsonschema.FormatChecker())
    assert arguments["unit"] == "celsius" and len(arguments["code"]) == 3


def test_budget_zero_answers_without_a_thought_where_the_template_opens_one_regardless(serve, tmp_path):
    """DeepSeek R1 Distill Llama's template opens <think> whatever it is told: with reasoning_budget
    0 the prompt closes it, and the whole answer is content; without, it is all thought."""
    model = write_tiny_model(tmp_path / "tiny.gguf", chat_template=real_template("deepseek-ai-DeepSeek-R1-Distill-Llama-8B"))
    client = openai.OpenAI(base_url=f"{serve(n_parallel=1, n_ctx=2048, model=model)}/v1", api_key="none", max_retries=0)
    asked = dict(model="tiny", messages=ASK, temperature=0, max_tokens=12)
    thinking = client.chat.completions.create(**asked).choices[0].message
    assert thinking.model_extra["reasoning_content"] and not thinking.content
    off = client.chat.completions.create(**asked, extra_body={"reasoning_budget": 0}).choices[0].message
    assert off.content and "reasoning_content" not in (off.model_extra or {})


def test_the_close_comes_exactly_at_the_budget(make_engine, family_models):
    engine = make_engine(family_models[R1])
    prompt = engine.chat_prompt(ASK, reasoning_budget=4)
    assert prompt.thinking_budget == ThinkingBudget(4, opened=True)  # R1's prompt opens the thought
    seq, = engine.add(prompt.tokens, SamplingParams(max_tokens=30, temperature=0, thinking_budget=prompt.thinking_budget))
    while engine.has_work:
        engine.step()
    close = engine.vocab.tokenize("\n</think>\n\n", add_special=False)
    generated = seq.tokens[seq.n_prompt:]
    assert generated[4:4 + len(close)] == close and "</think>" not in engine.vocab.detokenize(generated[:4])
    assert len(generated) == 30  # and the answer went on after it


def test_a_marker_that_is_a_control_token_shows_in_the_answer_and_its_calls_read_back(serve, tmp_path):
    """Mistral's [TOOL_CALLS] is a control token in its real vocabularies, which llama.cpp renders
    as nothing: the answer shows it (as llama-server's preserved tokens), so the call reads back."""
    model = write_tiny_model(tmp_path / "tiny.gguf", chat_template=real_template(MISTRAL), controls=("[TOOL_CALLS]",))
    client = openai.OpenAI(base_url=f"{serve(n_parallel=1, n_ctx=4096, model=model)}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=200)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert_valid(reply.choices[0].message.tool_calls)


def test_a_thought_marked_by_control_tokens_comes_apart_from_the_answer(tmp_path):
    """Magistral's [THINK] and [/THINK] are control tokens: a thought so marked shows its markers
    in the text (without them it would run into the answer) and comes apart from the answer."""
    from llamabatch.chat.conversation import Chat

    model = write_tiny_model(tmp_path / "tiny.gguf", controls=("[THINK]", "[/THINK]"))
    name = "mistralai-Ministral-3-14B-Reasoning-2512"
    with BatchEngine(model, n_parallel=1, n_ctx=2048, n_threads=1) as engine:
        chat = Chat(ChatTemplate(real_template(name), name, "<s>", "</s>"), engine.vocab, None)
        prompt = chat.prompt([{"role": "user", "content": "Hi"}])
        written = f'start: {chat.lark("[THINK]")} "the sea" {chat.lark("[/THINK]")} " Paris"'
        assert "<[" in written  # the markers are named as tokens: no text matches a control token
        [shown] = engine.generate([prompt.tokens], SamplingParams(max_tokens=20, temperature=0, lark=written, shown_tokens=prompt.shown_tokens))
        [hidden] = engine.generate([prompt.tokens], SamplingParams(max_tokens=20, temperature=0, lark=written))
    assert (shown.text, hidden.text) == ("[THINK]the sea[/THINK] Paris", "the sea Paris")
    message = prompt.answer.message(shown.text)
    assert (message["reasoning_content"], message["content"]) == ("the sea", "Paris")  # (the blank after a thought is not the answer's)


GPT_OSS = "openai-gpt-oss-120b"


def test_gpt_oss_calls_on_its_commentary_channel_and_its_analysis_is_the_reasoning(serve, tmp_path):
    """gpt-oss's harmony format: a required call is a message to the function on the commentary
    channel, read back as OpenAI's call; an answer's analysis channel is its reasoning and its
    final channel its content; budget 0 closes the analysis as it opens."""
    from llamabatch.chat.conversation import Chat

    model = write_tiny_model(tmp_path / "tiny.gguf", chat_template=real_template(GPT_OSS))
    client = openai.OpenAI(base_url=f"{serve(n_parallel=1, n_ctx=8192, model=model)}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=200, extra_body={"reasoning_budget": 0})
    assert reply.choices[0].finish_reason == "tool_calls" and len(reply.choices[0].message.tool_calls) == 1
    assert_valid(reply.choices[0].message.tool_calls)
    with BatchEngine(model, n_parallel=1, n_ctx=2048, n_threads=1) as engine:
        chat = Chat(ChatTemplate(real_template(GPT_OSS), GPT_OSS, "<s>", "</s>"), engine.vocab, None)
        prompt = chat.prompt(ASK, reasoning_budget=0)
        assert prompt.text.endswith("<|start|>assistant") and prompt.thinking_budget.markup.close == "<|end|>"
        answer = "<|channel|>analysis<|message|>Sunny, I think.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny."
        assert prompt.answer.message(answer) == {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Sunny, I think."}
        # budget 0: the analysis the model opens is closed for it at once, and its answer follows
        opened = 'start: "<|channel|>analysis<|message|>" /(.|\n){0,80}/'
        [result] = engine.generate([prompt.tokens], SamplingParams(max_tokens=60, temperature=0, lark=opened, thinking_budget=prompt.thinking_budget))
    opening = "<|channel|>analysis<|message|>"  # (the tiny vocabulary writes the closing with a blank before it)
    assert result.text.startswith(opening) and result.text[len(opening):].lstrip().startswith("<|end|><|start|>assistant")
