"""Chat templates as models ship them: the GGUF's `tokenizer.chat_template` (Jinja) rendered in a
sandbox with what Hugging Face's renderer gives templates (raise_exception, strftime_now, tools,
add_generation_prompt, a tojson that keeps Unicode), or one of llama.cpp's built-in templates by
name for a GGUF that carries none."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ChatTemplateError

BUILT_IN_MARK = "{%"  # Jinja text has tags; a llama.cpp built-in is a bare name ("chatml", "gemma")


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, > and & for HTML, which would change the prompt
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
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
        try:
            return self.compiled().render(
                messages=messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **kwargs,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template ({self.origin}) cannot render these messages: {e}") from None
        except (TypeError, AttributeError, KeyError, IndexError, ValueError) as e:  # a template reading a field the messages lack
            raise ChatTemplateError(f"chat template ({self.origin}) failed on these messages: {type(e).__name__}: {e}") from None
