"""Tool calls: how a model's template family writes them, the grammar that holds a call to its
tool's JSON schema, and the parser that turns an answer back into OpenAI's `tool_calls`.

Families (picked from the template's own markup, as llama-server's common/chat.cpp picks them):
- hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Hermes 2/3, Qwen 2.5 and 3);
- llama3: a bare `{"name": ..., "parameters": {...}}` answer (Llama 3.1-3.3);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "abcDEF123"}]` (Mistral Nemo);
- qwen3-coder: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>...` (Qwen3-Coder's XML);
- glm: `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>...` (GLM 4.5 and later);
- generic: any other template: the tools are described in a system message and the whole answer
  is one JSON object, `{"tool_calls": [...]}` or `{"response": "..."}`.

Under tool_choice "auto" the grammar is lazy: the answer is free text until the family's opening
marker, and from there the call must parse and validate. "required" and a named function hold
the answer to calls from its first token.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass

from ..errors import SamplingError

ALPHANUMERIC = string.ascii_letters + string.digits
# JSON as OpenAI's structured outputs write it (no free whitespace), so a small model cannot
# wander into runs of newlines inside a call
COMPACT = {"whitespace_flexible": False}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # a JSON schema for the arguments object

    @classmethod
    def of(cls, entry: dict) -> Tool:
        function = entry.get("function") or {}
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        return cls(function["name"], function.get("description"), closed(parameters))


def closed(schema):
    """The schema with every object that does not say otherwise closed to properties it does not
    list (additionalProperties: false), as OpenAI's strict mode and llama.cpp's grammar treat tool
    parameters: else a call may wander into keys no tool reads."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (closed(v) if k not in ("enum", "const", "default", "examples") else v) for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {name: closed(sub) for name, sub in schema["properties"].items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class Tools:
    """A request's tools and how it lets the model use them."""

    tools: tuple[Tool, ...]
    choice: str  # "auto", "none", "required", or the name of the one function to call
    parallel: bool = True

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice: str | dict | None, parallel: bool | None) -> Tools | None:
        """None without tools. Raises SamplingError for a choice that names no given tool."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise SamplingError("tool_choice needs tools")
            return None
        listed = tuple(Tool.of(t) for t in tools)
        names = [t.name for t in listed]
        if len(set(names)) < len(names):
            raise SamplingError(f"tools: function names must be unique, got {names}")
        choice = tool_choice or "auto"
        if isinstance(choice, dict):
            choice = choice["function"]["name"]
            if choice not in names:
                raise SamplingError(f"tool_choice names function {choice!r}, which is not among the tools ({', '.join(names)})")
        return cls(listed, choice, True if parallel is None else parallel)

    @property
    def constrained(self) -> bool:
        return self.choice != "none"

    @property
    def required(self) -> bool:
        return self.choice not in ("auto", "none")

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools a call may name: all of them, or the one tool_choice names."""
        if self.choice in ("auto", "none", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)


def call_schema(tools: tuple[Tool, ...], arguments_key: str = "arguments", extra: dict | None = None) -> dict:
    """A JSON schema for one call of any of these tools: {"name": <const>, arguments_key: <its parameters>}."""
    variants = []
    for tool in tools:
        properties = {"name": {"const": tool.name}, arguments_key: tool.parameters, **(extra or {})}
        variants.append({"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False})
    return {"anyOf": variants, "x-guidance": COMPACT} if len(variants) > 1 else {**variants[0], "x-guidance": COMPACT}


def _json(schema: dict) -> str:
    return "%json " + json.dumps(schema)


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a Lark one


def new_call_id(family: str) -> str:
    if family == "mistral":  # Mistral's templates refuse any other id shape
        return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


class ToolFormat:
    """One family's way of writing calls."""

    name = "generic"
    trigger: str | None = None  # text that opens a call; None: the answer is the call

    def __init__(self, trigger_token: int | None = None) -> None:
        # the trigger as one special token of the vocabulary (not text a grammar can match)
        self.trigger_token = trigger_token

    @staticmethod
    def detect(template_source: str) -> ToolFormat:
        """The family a template writes calls in; generic for one without tool markup."""
        for family in (Mistral, QwenXml, GlmXml, Hermes, Llama3):
            if family.marks(template_source):
                return family()
        return Generic()

    @classmethod
    def marks(cls, source: str) -> bool:
        return False

    @property
    def renders_tools(self) -> bool:
        """The template itself shows the tools to the model (else we describe them)."""
        return True

    def grammar(self, tools: Tools) -> str:
        raise NotImplementedError

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str, list[ToolCall]]:
        """The answer's text without its calls, and the calls (complete ones only). `tools`:
        the request's, for families whose calls need their schemas to be read."""
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Where a call begins in the text (or may begin, a partial marker at its end), so a stream
        holds it back; None while none can."""
        if self.trigger is None:
            return None
        at = text.find(self.trigger)
        if at >= 0:
            return at
        for k in range(min(len(self.trigger) - 1, len(text)), 0, -1):
            if text.endswith(self.trigger[:k]):
                return len(text) - k
        return None

    def _opening(self) -> str:
        return f"<[{self.trigger_token}]>" if self.trigger_token is not None else _lark_string(self.trigger)

    def _lazy(self, tools: Tools, call: str, more: str) -> str:
        """Free text, or calls from the opening marker on; only calls when they are required."""
        opening = self._opening()
        repeat = f"\nmore: \"\" | {more} {opening} call more" if tools.parallel else '\nmore: ""'
        if tools.required:
            return f"start: {opening} call more\ncall: {call}{repeat}\n"
        if self.trigger_token is not None:  # a special token cannot occur in text: no stop needed
            return f"start: TEXT | TEXT? {opening} call more\nTEXT: /(.|\\n)+/\ncall: {call}{repeat}\n"
        return (
            f"start: TEXT | text call more\nTEXT: /(.|\\n)*/\n"
            f"text[stop={_lark_string(self.trigger)}]: /(.|\\n)*/\ncall: {call}{repeat}\n"
        )


class Hermes(ToolFormat):
    name = "hermes"
    trigger = "<tool_call>"
    _call = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)

    @classmethod
    def marks(cls, source: str) -> bool:
        return "<tool_call>" in source

    def grammar(self, tools: Tools) -> str:
        return self._lazy(tools, f'"\\n" {_json(call_schema(tools.callable))} "\\n</tool_call>"', '"\\n"?')

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str, list[ToolCall]]:
        start = text.find(self.trigger)
        if start < 0:
            return text, []
        calls = [c for m in self._call.finditer(text, start) if (c := _decoded(m.group(1), "arguments", self.name))]
        return (text[:start].rstrip(), calls) if calls else (text, [])  # a call cut short stays text


class XmlCalls(ToolFormat):
    """Calls written as XML, one block per argument (strings as they are, other values as JSON),
    in a family's own tags: after the trigger, function_open, then each argument between
    param_open and value_close, then function_close."""

    trigger = "<tool_call>"
    _function: re.Pattern
    _parameter: re.Pattern

    def function_open(self, name: str) -> str:
        raise NotImplementedError

    def param_open(self, key: str) -> str:
        raise NotImplementedError

    value_close = ""  # what ends a value (a raw string runs up to it)
    after_value = ""  # what follows value_close before the next argument
    function_close = ""

    def grammar(self, tools: Tools) -> str:
        rules, names = [], []
        for i, tool in enumerate(tools.callable):
            params = []
            properties = tool.parameters.get("properties") or {}
            required = set(tool.parameters.get("required") or ())
            for j, (key, schema) in enumerate(properties.items()):
                rule, opening = f"p{i}_{j}", _lark_string(self.param_open(key))
                bounded = _bounded_string(schema)
                if bounded is None and _free_string(schema):  # raw text up to the closing tag
                    rules.append(f"{rule}: {opening} v{i}_{j} {_lark_string(self.after_value)}\n"
                                 f"v{i}_{j}[stop={_lark_string(self.value_close)}]: /(.|\\n)*/")
                else:
                    if bounded is not None:
                        value = bounded
                    elif _string_enum(schema):
                        value = " | ".join(_lark_string(v) for v in schema["enum"])
                    else:
                        value = _json({**schema, "x-guidance": COMPACT})
                    rules.append(f"{rule}: {opening} ({value}) {_lark_string(self.value_close + self.after_value)}")
                params.append(rule if key in required else f"{rule}?")
            rules.append(f"f{i}: {_lark_string(self.function_open(tool.name))} {' '.join(params)} {_lark_string(self.function_close)}")
            names.append(f"f{i}")
        return self._lazy(tools, f"({' | '.join(names)})", '"\\n"?') + "\n".join(rules) + "\n"

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str, list[ToolCall]]:
        start = text.find(self.trigger)
        if start < 0:
            return text, []
        schemas = {t.name: t.parameters.get("properties") or {} for t in (tools.tools if tools else ())}
        calls = []
        for name, body in self._function.findall(text, start):
            properties = schemas.get(name.strip(), {})
            arguments = {key.strip(): _xml_value(value, properties.get(key.strip(), {})) for key, value in self._parameter.findall(body)}
            calls.append(ToolCall(name.strip(), json.dumps(arguments, ensure_ascii=False), new_call_id(self.name)))
        return (text[:start].rstrip(), calls) if calls else (text, [])


class QwenXml(XmlCalls):
    """Qwen3-Coder: <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>."""

    name = "qwen3-coder"
    _function = re.compile(r"<function=([^>\n]+)>\n?(.*?)</function>", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
    value_close, after_value, function_close = "\n</parameter>", "\n", "</function>\n</tool_call>"

    @classmethod
    def marks(cls, source: str) -> bool:
        return "<function=" in source and "<parameter=" in source

    def function_open(self, name: str) -> str:
        return f"\n<function={name}>\n"

    def param_open(self, key: str) -> str:
        return f"<parameter={key}>\n"


class GlmXml(XmlCalls):
    """GLM 4.5+: <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n...</tool_call>."""

    name = "glm"
    _function = re.compile(r"<tool_call>([^\n<]+)\n?(.*?)</tool_call>", re.DOTALL)
    _parameter = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
    value_close, after_value, function_close = "</arg_value>", "\n", "</tool_call>"

    @classmethod
    def marks(cls, source: str) -> bool:
        return "<arg_key>" in source and "<arg_value>" in source

    def function_open(self, name: str) -> str:
        return f"{name}\n"

    def param_open(self, key: str) -> str:
        return f"<arg_key>{key}</arg_key>\n<arg_value>"


def _string_enum(schema: dict) -> bool:
    return schema.get("type") == "string" and isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"])


def _free_string(schema: dict) -> bool:
    return schema.get("type") == "string" and not _string_enum(schema) and not any(k in schema for k in ("pattern", "format", "const"))


def _bounded_string(schema: dict) -> str | None:
    """A string argument written as it is between tags, as a Lark terminal held to its schema:
    its const, its pattern (anchored as JSON Schema reads it: a match anywhere unless ^...$), or
    its length bounds; such a value holds no "<" (its closing tag follows it). None for a string
    with none of these (it runs up to its closing tag), or one that is not a plain string."""
    if schema.get("type") != "string" or _string_enum(schema) or "format" in schema:
        return None
    if "const" in schema:
        return _lark_string(str(schema["const"]))
    if "pattern" in schema:
        pattern = schema["pattern"]
        core = pattern[1:-1] if pattern.startswith("^") and pattern.endswith("$") else f"[^<]*(?:{pattern})[^<]*"
        return "/" + core.replace("/", "\\/") + "/"
    if "maxLength" in schema or "minLength" in schema:
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        return f"/[^<]{{{low},{'' if high is None else int(high)}}}/"
    return None


def _xml_value(text: str, schema: dict):
    """A parameter's value: strings as written (a string with a format, written as JSON, read as
    such), anything else read as JSON (Python's True and False, as the template writes booleans, too)."""
    if schema.get("type") == "string" and not ("format" in schema and text.strip().startswith('"')):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"True": True, "False": False}.get(text.strip(), text)


class Llama3(ToolFormat):
    name = "llama3"
    python_tag = "<|python_tag|>"

    @classmethod
    def marks(cls, source: str) -> bool:
        return "<|start_header_id|>" in source and ("ipython" in source or '"parameters"' in source)

    def grammar(self, tools: Tools) -> str:
        call = _json(call_schema(tools.callable, "parameters"))
        repeat = '\nmore: "" | ";" call more' if tools.parallel else '\nmore: ""'
        if tools.required:
            return f"start: call more\ncall: {call}{repeat}\n"
        return f"start: TEXT | call more\nTEXT: /([^{{](.|\\n)*)?/\ncall: {call}{repeat}\n"  # text: anything not opening with {

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix(self.python_tag).lstrip()
        if not body.startswith("{"):
            return text, []
        calls, decoder, at = [], json.JSONDecoder(), 0
        while at < len(body):
            try:
                value, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return (text, []) if not calls else ("", calls)
            call = _call_of(value, "parameters", self.name)
            if call is None:
                return (text, []) if not calls else ("", calls)
            calls.append(call)
            at = len(body) - len(body[at:].lstrip().lstrip(";").lstrip())
        return "", calls

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if not stripped:
            return 0  # nothing yet says whether this answer is a call
        if stripped[0] == "{" or self.python_tag.startswith(stripped[: len(self.python_tag)]):
            return len(text) - len(stripped)
        return None


class Mistral(ToolFormat):
    name = "mistral"
    trigger = "[TOOL_CALLS]"

    @classmethod
    def marks(cls, source: str) -> bool:
        return "[TOOL_CALLS]" in source and "[ARGS]" not in source  # [ARGS]: Mistral Small 3.2's other form

    def grammar(self, tools: Tools) -> str:
        one = call_schema(tools.callable, extra={"id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}})
        array = {"type": "array", "items": one, "minItems": 1, **({} if tools.parallel else {"maxItems": 1}), "x-guidance": COMPACT}
        opening = self._opening()
        if tools.required:
            return f"start: {opening} {_json(array)}\n"
        if self.trigger_token is not None:
            return f"start: TEXT | TEXT? {opening} calls\nTEXT: /(.|\\n)+/\ncalls: {_json(array)}\n"
        return f"start: TEXT | text calls\nTEXT: /(.|\\n)*/\ntext[stop={_lark_string(self.trigger)}]: /(.|\\n)*/\ncalls: {_json(array)}\n"

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str, list[ToolCall]]:
        start = text.find(self.trigger)
        if start < 0:
            return text, []
        calls = [c for v in _array_items(text[start + len(self.trigger):]) if (c := _call_of(v, "arguments", self.name))]
        return (text[:start].rstrip(), calls) if calls else (text, [])  # a call cut short stays text


class Generic(ToolFormat):
    name = "generic"

    @property
    def renders_tools(self) -> bool:
        return False

    def grammar(self, tools: Tools) -> str:
        calls = {"type": "array", "items": call_schema(tools.callable), "minItems": 1, **({} if tools.parallel else {"maxItems": 1})}
        answers = [{"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"], "additionalProperties": False}]
        if not tools.required:
            answers.append({"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                            "additionalProperties": False})
        return f"start: {_json({'anyOf': answers, 'x-guidance': COMPACT})}\n"

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str, list[ToolCall]]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("response"), str):
            return value["response"], []
        opening = re.match(r'\s*\{\s*"tool_calls"\s*:', text)
        calls = [c for v in _array_items(text[opening.end():]) if (c := _call_of(v, "arguments", self.name))] if opening else []
        return ("", calls) if calls else (text, [])

    def call_start(self, text: str) -> int | None:
        return 0  # the whole answer is one JSON object: nothing streams as text before it is complete

    def system_prompt(self, tools: Tools) -> str:
        """What the model is told, in a system message, when its template says nothing of tools."""
        listed = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}) for t in tools.tools)
        answer = ('{"tool_calls": [{"name": <function name>, "arguments": <arguments object>}]}' if tools.required else
                  'either {"tool_calls": [{"name": <function name>, "arguments": <arguments object>}]} to call functions, '
                  'or {"response": <your answer>}')
        return f"You can call these functions:\n{listed}\n\nAnswer with one JSON object: {answer}."


def _array_items(text: str) -> list:
    """The complete items of a JSON array, also of one cut short (an answer that ran out of tokens
    keeps the calls it finished)."""
    decoder, at = json.JSONDecoder(), len(text) - len(text.lstrip())
    if not text[at:].startswith("["):
        return []
    items, at = [], at + 1
    while True:
        rest = text[at:].lstrip()
        at = len(text) - len(rest)
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return items
        items.append(value)
        rest = text[at:].lstrip()
        if not rest.startswith(","):
            return items
        at = len(text) - len(rest) + 1


def _decoded(text: str, arguments_key: str, family: str) -> ToolCall | None:
    try:
        return _call_of(json.loads(text), arguments_key, family)
    except json.JSONDecodeError:
        return None


def _call_of(value, arguments_key: str, family: str) -> ToolCall | None:
    """A call from a decoded {"name": ..., arguments_key: {...}} (or "arguments" for any family)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    call_id = value.get("id") if isinstance(value.get("id"), str) and value.get("id") else new_call_id(family)
    return ToolCall(value["name"], text, call_id)
