"""Tool calls: how a model's template family writes them, the grammar that holds a call to its
tool's JSON schema, and the parser that turns an answer back into OpenAI's `tool_calls`.

Families (picked from the template's own markup, as llama-server's common/chat.cpp picks them):
- hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Hermes 2/3, Qwen 2.5 and 3);
- llama3: a bare `{"name": ..., "parameters": {...}}` answer (Llama 3.1-3.3);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "abcDEF123"}]` (Mistral Nemo);
- qwen3-coder: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>...` (Qwen3-Coder's XML);
- glm: `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>...` (GLM 4.5 and later);
- gpt-oss: a message to the function on the commentary channel,
  ` to=functions.NAME<|channel|>commentary json<|message|>{...}`, which ends the answer;
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
from collections.abc import Callable
from dataclasses import dataclass, replace

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


def call_schema(tools: tuple[Tool, ...], arguments_key: str = "arguments", properties_of: Callable[[Tool], dict] | None = None) -> dict:
    """A JSON schema for one call of any of these tools: {"name": <const>, arguments_key: <its
    parameters>}, or the properties properties_of gives, in their order."""
    variants = []
    for tool in tools:
        properties = properties_of(tool) if properties_of else {"name": {"const": tool.name}, arguments_key: tool.parameters}
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

    def __init__(self, literal: Callable[[str], str] = _lark_string) -> None:
        # a marker as a Lark sequence: its text, or (Chat.lark) the control tokens in it named as
        # tokens, which no text matches
        self.literal = literal

    @staticmethod
    def detect(template_source: str) -> ToolFormat:
        """The family a template writes calls in; generic for one without tool markup."""
        for family in (Harmony, KimiK2, DeepSeekV31, CommandR, MiniMaxXml, DsmlXml, Mistral, QwenXml, GlmXml, Hermes, Llama3):
            if family.marks(template_source):
                return family.of(template_source)
        return Generic()

    @classmethod
    def of(cls, template_source: str) -> ToolFormat:
        """The family's format as this template writes it."""
        return cls()

    @classmethod
    def marks(cls, source: str) -> bool:
        return False

    @property
    def markers(self) -> tuple[str, ...]:
        """The texts that mark its calls, which the answer must show to be read back."""
        return (self.trigger,) if self.trigger else ()

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
        return None if self.trigger is None else _marker_start(text, self.trigger)

    def _opening(self) -> str:
        return self.literal(self.trigger)

    @property
    def _special_trigger(self) -> bool:
        """The trigger holds a control token, which no text can be: free text needs no stop."""
        return "<[" in self._opening()

    def _lazy(self, tools: Tools, call: str, more: str) -> str:
        """Free text, or calls from the opening marker on; only calls when they are required."""
        opening = self._opening()
        repeat = f"\nmore: \"\" | {more} {opening} call more" if tools.parallel else '\nmore: ""'
        if tools.required:
            return f"start: {opening} call more\ncall: {call}{repeat}\n"
        if self._special_trigger:  # a special token cannot occur in text: no stop needed
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
    _function: re.Pattern  # group 1: the function's name, group 2: its arguments' blocks
    _parameter: re.Pattern  # group 1: the argument's name, group 2: its value

    def function_open(self, name: str) -> str:
        raise NotImplementedError

    def param_open(self, key: str, schema: dict) -> str:
        raise NotImplementedError

    value_close = ""  # what ends a value (a raw string runs up to it)
    after_value = ""  # what follows value_close before the next argument
    function_close = ""

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.trigger, self.value_close, self.function_close)

    def grammar(self, tools: Tools) -> str:
        rules, names = [], []
        for i, tool in enumerate(tools.callable):
            params = []
            properties = tool.parameters.get("properties") or {}
            required = set(tool.parameters.get("required") or ())
            for j, (key, schema) in enumerate(properties.items()):
                rule, opening = f"p{i}_{j}", self.literal(self.param_open(key, schema))
                bounded = _bounded_string(schema)
                if bounded is None and _free_string(schema):  # raw text up to the closing tag
                    rules.append(f"{rule}: {opening} {self._raw_value(f'v{i}_{j}')}")
                else:
                    if bounded is not None:
                        value = bounded
                    elif _string_enum(schema):
                        value = " | ".join(_lark_string(v) for v in schema["enum"])
                    else:
                        value = _json({**schema, "x-guidance": COMPACT})
                    rules.append(f"{rule}: {opening} ({value}) {self.literal(self.value_close)} {self.literal(self.after_value)}")
                params.append(rule if key in required else f"{rule}?")
            rules.append(f"f{i}: {self.literal(self.function_open(tool.name))} {' '.join(params)} {self.literal(self.function_close)}")
            names.append(f"f{i}")
        return self._lazy(tools, f"({' | '.join(names)})", '"\\n"?') + "\n".join(rules) + "\n"

    def _raw_value(self, name: str) -> str:
        """A string as it is, up to the value's closing tag, and the rule that reads it."""
        close, after = self.literal(self.value_close), self.literal(self.after_value)
        if "<[" in close:  # a control token: no text matches it, so none runs past it
            return f"/(.|\\n)*/ {close} {after}"
        return f"{name} {after}\n{name}[stop={_lark_string(self.value_close)}]: /(.|\\n)*/"

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

    def param_open(self, key: str, schema: dict) -> str:
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

    def param_open(self, key: str, schema: dict) -> str:
        return f"<arg_key>{key}</arg_key>\n<arg_value>"


class MiniMaxXml(XmlCalls):
    """MiniMax M2: <minimax:tool_call>\n<invoke name="NAME">\n<parameter name="KEY">VALUE</parameter>\n...</invoke>\n</minimax:tool_call>."""

    name = "minimax-m2"
    trigger = "<minimax:tool_call>"
    _function = re.compile(r'<invoke name="([^"]+)">\n?(.*?)</invoke>', re.DOTALL)
    _parameter = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)
    value_close, after_value, function_close = "</parameter>", "\n", "</invoke>\n</minimax:tool_call>"

    @classmethod
    def marks(cls, source: str) -> bool:
        return "<minimax:tool_call>" in source and "<invoke name=" in source

    def function_open(self, name: str) -> str:
        return f'\n<invoke name="{name}">\n'

    def param_open(self, key: str, schema: dict) -> str:
        return f'<parameter name="{key}">'


DSML = "\uff5cDSML\uff5c"  # DeepSeek's markup prefix, between fullwidth bars


class DsmlXml(XmlCalls):
    """DeepSeek V3.2 and V4: <｜DSML｜function_calls> (V4: tool_calls) holding
    <｜DSML｜invoke name="NAME"> with <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>,
    strings as they are and other values as JSON."""

    name = "deepseek-dsml"
    _function = re.compile(f'<{DSML}invoke name="([^"]+)">\\n?(.*?)</{DSML}invoke>', re.DOTALL)
    _parameter = re.compile(f'<{DSML}parameter name="([^"]+)"(?: string="(?:true|false)")?>(.*?)</{DSML}parameter>', re.DOTALL)
    value_close, after_value = f"</{DSML}parameter>", "\n"

    def __init__(self, literal: Callable[[str], str] = _lark_string, block: str = "function_calls") -> None:
        super().__init__(literal)
        self.block = block
        self.trigger = f"<{DSML}{block}>"
        self.function_close = f"</{DSML}invoke>\n</{DSML}{block}>"

    @classmethod
    def marks(cls, source: str) -> bool:
        return DSML in source and "invoke name=" in source

    @classmethod
    def of(cls, source: str) -> DsmlXml:
        return cls(block="tool_calls" if "tool_calls>" in source else "function_calls")

    def function_open(self, name: str) -> str:
        return f'\n<{DSML}invoke name="{name}">\n'

    def param_open(self, key: str, schema: dict) -> str:
        return f'<{DSML}parameter name="{key}" string="{"true" if schema.get("type") == "string" else "false"}">'


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


class ArrayCalls(ToolFormat):
    """The calls as one JSON array of objects after the trigger (then a close)."""

    name_key, arguments_key = "name", "arguments"
    close = ""

    def properties(self, tool: Tool) -> dict:
        """A call object's properties and their schemas, in the order the model writes them."""
        return {self.name_key: {"const": tool.name}, self.arguments_key: tool.parameters}

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.trigger, self.close)

    def grammar(self, tools: Tools) -> str:
        one = call_schema(tools.callable, properties_of=self.properties)
        array = {"type": "array", "items": one, "minItems": 1, **({} if tools.parallel else {"maxItems": 1}), "x-guidance": COMPACT}
        calls = _json(array) + (f" {self.literal(self.close)}" if self.close else "")
        opening = self._opening()
        if tools.required:
            return f"start: {opening} calls\ncalls: {calls}\n"
        if self._special_trigger:
            return f"start: TEXT | TEXT? {opening} calls\nTEXT: /(.|\\n)+/\ncalls: {calls}\n"
        return f"start: TEXT | text calls\nTEXT: /(.|\\n)*/\ntext[stop={_lark_string(self.trigger)}]: /(.|\\n)*/\ncalls: {calls}\n"

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str, list[ToolCall]]:
        start = text.find(self.trigger)
        if start < 0:
            return text, []
        items = _array_items(text[start + len(self.trigger):])
        calls = [c for v in items if (c := _call_of(v, self.arguments_key, self.name, self.name_key))]
        return (text[:start].rstrip(), calls) if calls else (text, [])  # a call cut short stays text


class Mistral(ArrayCalls):
    """Mistral Nemo: [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "abcDEF123"}]."""

    name = "mistral"
    trigger = "[TOOL_CALLS]"

    @classmethod
    def marks(cls, source: str) -> bool:
        return "[TOOL_CALLS]" in source and "[ARGS]" not in source  # [ARGS]: Mistral Small 3.2's other form

    def properties(self, tool: Tool) -> dict:  # an id of the nine characters its template checks
        return {**super().properties(tool), "id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}}


class CommandR(ArrayCalls):
    """Command R7B and Command A: <|START_ACTION|>[{"tool_call_id": "0", "tool_name": ..., "parameters": {...}}]<|END_ACTION|>."""

    name = "command-r"
    trigger, close = "<|START_ACTION|>", "<|END_ACTION|>"
    name_key, arguments_key = "tool_name", "parameters"

    @classmethod
    def marks(cls, source: str) -> bool:
        return "<|START_ACTION|>" in source and "<|END_ACTION|>" in source

    def properties(self, tool: Tool) -> dict:
        return {"tool_call_id": {"type": "string", "pattern": "^[0-9]{1,3}$"}, **super().properties(tool)}


class HeadedCalls(ToolFormat):
    """Calls each written as a head that names the function, its arguments as one JSON object,
    and a close; in a section of their own (section_close after the last), or each opened by
    the trigger."""

    _head: re.Pattern  # group 1: the function's name; the arguments' object follows it
    call_close = ""
    section_close = ""  # "": each call is opened by the trigger again

    def head(self, tool: Tool) -> str:
        """The Lark sequence that opens a call of this tool."""
        raise NotImplementedError

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.trigger, self.call_close, self.section_close)

    def grammar(self, tools: Tools) -> str:
        close = f" {self.literal(self.call_close)}" if self.call_close else ""
        rules = "".join(f"f{i}: {self.head(t)} {_json({**t.parameters, 'x-guidance': COMPACT})}{close}\n"
                        for i, t in enumerate(tools.callable))
        one = "(" + " | ".join(f"f{i}" for i in range(len(tools.callable))) + ")"
        if not self.section_close:
            return self._lazy(tools, one, '"\\n"?') + rules
        calls = f"{one}+" if tools.parallel else one
        return self._lazy(replace(tools, parallel=False), f"{calls} {self.literal(self.section_close)}", '""') + rules

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str, list[ToolCall]]:
        start = text.find(self.trigger.strip())
        if start < 0:
            return text, []
        calls, decoder = [], json.JSONDecoder()
        for m in self._head.finditer(text, start):
            try:
                value, _ = decoder.raw_decode(text, m.end())
            except json.JSONDecodeError:
                continue  # a call cut short
            if isinstance(value, dict):
                calls.append(ToolCall(m.group(1).strip(), json.dumps(value, ensure_ascii=False), new_call_id(self.name)))
        return (text[:start].rstrip(), calls) if calls else (text, [])


class Harmony(HeadedCalls):
    """gpt-oss's harmony format: a call is a message of its own, addressed to the function, on the
    commentary channel, ` to=functions.NAME<|channel|>commentary json<|message|>{...}` after the
    assistant's header; `<|call|>` ends the answer, so an answer holds one call."""

    name = "gpt-oss"
    trigger = " to=functions."
    # the recipient in the header (as the template writes calls) or in the channel (as the model also does)
    _head = re.compile(r"to=functions\.([^\s<]+)\s*(?:<\|channel\|>\w+)?\s*(?:<\|constrain\|>)?[\w-]*\s*<\|message\|>")

    @classmethod
    def marks(cls, source: str) -> bool:
        return "<|channel|>commentary" in source and "functions." in source

    def head(self, tool: Tool) -> str:
        return self.literal(f"{tool.name}<|channel|>commentary json<|message|>")

    def grammar(self, tools: Tools) -> str:
        return super().grammar(replace(tools, parallel=False))

    def call_start(self, text: str) -> int | None:
        # the marker with its space, or without: an answer after a thought starts at "to="
        starts = [at for marker in (self.trigger, self.trigger.strip()) if (at := _marker_start(text, marker)) is not None]
        return min(starts, default=None)


class KimiK2(HeadedCalls):
    """Kimi K2: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>."""

    name = "kimi-k2"
    trigger = "<|tool_calls_section_begin|>"
    _head = re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([^\s:<]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>")
    call_close, section_close = "<|tool_call_end|>", "<|tool_calls_section_end|>"

    @classmethod
    def marks(cls, source: str) -> bool:
        return "<|tool_calls_section_begin|>" in source and "<|tool_call_argument_begin|>" in source

    @property
    def markers(self) -> tuple[str, ...]:
        return (*super().markers, "<|tool_call_begin|>", "<|tool_call_argument_begin|>")

    def head(self, tool: Tool) -> str:
        # its id: functions.NAME:INDEX, the index counted over the conversation's calls
        return f'{self.literal("<|tool_call_begin|>")} "functions.{tool.name}:" /[0-9]{{1,3}}/ {self.literal("<|tool_call_argument_begin|>")}'


DEEPSEEK_CALLS, DEEPSEEK_CALL, DEEPSEEK_SEP = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581sep\uff5c>"


class DeepSeekV31(HeadedCalls):
    """DeepSeek V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>."""

    name = "deepseek-v3.1"
    trigger = DEEPSEEK_CALLS
    _head = re.compile(f"{re.escape(DEEPSEEK_CALL)}([^<\n]+?){re.escape(DEEPSEEK_SEP)}")
    call_close, section_close = "<\uff5ctool\u2581call\u2581end\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"

    @classmethod
    def marks(cls, source: str) -> bool:
        # (R1's form puts the type before the separator and the arguments in a ```json block)
        return DEEPSEEK_SEP in source and "```json" not in source

    @property
    def markers(self) -> tuple[str, ...]:
        return (*super().markers, DEEPSEEK_CALL, DEEPSEEK_SEP)

    def head(self, tool: Tool) -> str:
        return f"{self.literal(DEEPSEEK_CALL)} {_lark_string(tool.name)} {self.literal(DEEPSEEK_SEP)}"


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


def _marker_start(text: str, marker: str) -> int | None:
    """Where the marker begins in the text, or a part of it at the text's end; None for neither."""
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return None


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


def _call_of(value, arguments_key: str, family: str, name_key: str = "name") -> ToolCall | None:
    """A call from a decoded {name_key: ..., arguments_key: {...}} (or "arguments" for any family)."""
    if not isinstance(value, dict) or not isinstance(value.get(name_key), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    call_id = value.get("id") if isinstance(value.get("id"), str) and value.get("id") else new_call_id(family)
    return ToolCall(value[name_key], text, call_id)
