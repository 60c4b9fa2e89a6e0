"""Chat templates as models ship them: the GGUF's `tokenizer.chat_template` (Jinja) rendered in a
sandbox with what Hugging Face's renderer gives templates (raise_exception, strftime_now, tools,
add_generation_prompt, a tojson that keeps Unicode, the `{% generation %}` block), or one of
llama.cpp's built-in templates by name for a GGUF that carries none.

Where a template cannot take what a client sends, it is helped as llama.cpp's renderer helps it:
`tools` is left undefined when there are none (templates iterate it unguarded); the date and
firefunction's `functions` are given; a template that has no system role (it raises on one, or
drops its text) gets the system text folded into the next message."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import SandboxedEnvironment

from ..errors import ChatTemplateError

BUILT_IN_MARK = "{%"  # Jinja text has tags; a llama.cpp built-in is a bare name ("chatml", "gemma")


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, > and & for HTML, which would change the prompt; a filter's
    # output (`tools | map(attribute='function')`) is a generator, written as the list it yields
    if isinstance(value, Iterator):
        value = list(value)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class GenerationBlock(Extension):
    """Hugging Face's `{% generation %}...{% endgeneration %}`, which marks the assistant's tokens
    for training masks: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> SandboxedEnvironment:
    # Sandboxed (no attribute a template could escape through), but lists and dicts may change:
    # templates keep their own state in them (Kimi K2's queue of call ids appends), as llama.cpp's
    # renderer lets them; what a template is given is built for that one rendering.
    env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template: Jinja `source`, or the name of a llama.cpp built-in."""

    source: str
    origin: str  # where it came from, for messages: "the GGUF", a file, "built-in chatml"
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def choose(cls, override: str | None, gguf: str | None, fallback: str | None, bos: str = "", eos: str = "") -> ChatTemplate | None:
        """--chat-template (a Jinja file, or a built-in's name) over the GGUF's own over the
        catalog's built-in for GGUFs without one; None when there is none at all."""
        if override is not None:
            path = Path(override)
            if path.suffix in (".jinja", ".j2", ".txt") or path.is_file():
                try:
                    return cls(path.read_text(), f"{path.name}", bos, eos)
                except (OSError, UnicodeDecodeError) as e:
                    raise ChatTemplateError(f"--chat-template {override}: cannot read it ({e})") from None
            return cls(override, f"built-in {override}", bos, eos)
        if gguf:
            return cls(gguf, "the GGUF's template", bos, eos)
        if fallback:
            return cls(fallback, f"built-in {fallback}", bos, eos)
        return None

    @property
    def is_jinja(self) -> bool:
        return BUILT_IN_MARK in self.source or "{{" in self.source

    def compiled(self) -> jinja2.Template:
        """The compiled template; raises ChatTemplateError for one that does not parse."""
        try:
            return _compile(self.source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template ({self.origin}) does not parse: {e}") from None

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt for these messages; raises ChatTemplateError with the template's own message
        (its raise_exception, or a Jinja error) when it cannot render them."""
        if not self.is_jinja:
            raise ChatTemplateError(f"chat template {self.origin} is llama.cpp's, not Jinja: render it with the model")
        if not self.has_system_role:
            messages = _system_folded(messages)
        return self._render(messages, tools, add_generation_prompt, **kwargs)

    @cached_property
    def has_system_role(self) -> bool:
        """Whether the template shows a system message (llama.cpp's test: it renders one without
        raising, and its text is in the prompt)."""
        probe = [{"role": "system", "content": "System message"}, {"role": "user", "content": "User message"}]
        try:
            return "System message" in self._render(probe, None, True)
        except ChatTemplateError:
            return False

    def _render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool, **kwargs) -> str:
        now = datetime.now()
        given = {"tools": tools} if tools else {}  # none: undefined, as llama.cpp leaves it (templates iterate it unguarded)
        context = {"datetime": now.strftime("%b %d %Y"), "date_string": now.strftime("%d %b %Y"),
                   "functions": json.dumps(tools, indent=2) if tools else "", **given, **kwargs}
        try:
            return self.compiled().render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token, eos_token=self.eos_token,
                **context,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template ({self.origin}) cannot render these messages: {e}") from None
        except (TypeError, AttributeError, KeyError, IndexError, ValueError) as e:  # a template reading a field the messages lack
            raise ChatTemplateError(f"chat template ({self.origin}) failed on these messages: {type(e).__name__}: {e}") from None


def _system_folded(messages: list[dict]) -> list[dict]:
    """A leading system message's text put before the next message's, with a newline (llama.cpp's
    polyfill for templates without a system role); alone, it is dropped."""
    if not messages or messages[0].get("role") != "system":
        return messages
    if len(messages) == 1:
        return []
    system, first, *rest = messages
    return [{**first, "content": f"{_text(system)}\n{_text(first)}"}, *rest]


def _text(message: dict) -> str:
    content = message.get("content") or ""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content if isinstance(p, dict))
