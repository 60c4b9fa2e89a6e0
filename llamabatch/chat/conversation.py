"""A model's chat format in one place: messages (with tools) in, the prompt and the grammar its
answer is held to out, and the answer read back as OpenAI's assistant message, whole or streamed."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .reasoning import Reasoning, ReasoningStream, ThinkingBudget, markup_of
from .template import ChatTemplate
from .tools import Generic, ToolFormat, Tools


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    tokens: list[int]
    lark: str | None  # the grammar tool calls are held to (None: unconstrained)
    answer: Answer
    thinking_budget: ThinkingBudget | None = None  # the thought closed after so many tokens
    shown_tokens: tuple[int, ...] = ()  # the format's markers that are control tokens: shown in the answer


@dataclass(frozen=True)
class Answer:
    """How to read one request's answers: its tools' family and its reasoning markup."""

    tools: Tools | None = None
    format: ToolFormat | None = None
    reasoning: Reasoning | None = None

    def message(self, text: str) -> dict:
        """OpenAI's assistant message for a whole answer."""
        return self.assembled(self.stream().feed(text, final=True))

    @staticmethod
    def assembled(deltas: list[dict]) -> dict:
        """OpenAI's assistant message made of an answer's stream deltas (AnswerStream.feed)."""
        message: dict = {"role": "assistant", "content": "".join(d.get("content", "") for d in deltas)}
        thought = "".join(d.get("reasoning_content", "") for d in deltas)
        if thought:
            message["reasoning_content"] = thought
        calls = [call for d in deltas for call in d.get("tool_calls", ())]
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
            message["content"] = message["content"] or None
        return message

    @staticmethod
    def finish_reason(reason: str | None, called: bool) -> str | None:
        """OpenAI's "tool_calls" for an answer that ended well by calling."""
        return "tool_calls" if reason == "stop" and called else reason

    def stream(self) -> AnswerStream:
        return AnswerStream(self)


@dataclass
class AnswerStream:
    """Turns an answer's text pieces into chat deltas: reasoning_content as it comes, content up to
    where a call may begin, and the calls once the answer is complete."""

    answer: Answer
    thinking: ReasoningStream | None = None
    held: str = ""  # answer text that may be (the start of) a call
    n_calls: int = 0

    @property
    def called(self) -> bool:
        return self.n_calls > 0

    def __post_init__(self) -> None:
        if self.answer.reasoning is not None:
            self.thinking = self.answer.reasoning.streamed()

    def feed(self, piece: str, final: bool = False) -> list[dict]:
        deltas = []
        thought, text = self.thinking.feed(piece, final) if self.thinking else ("", piece)
        if thought:
            deltas.append({"reasoning_content": thought})
        parsing = self.answer.format is not None and self.answer.tools is not None and self.answer.tools.constrained
        if not parsing:
            return deltas + ([{"content": text}] if text else [])
        self.held += text
        start = self.answer.format.call_start(self.held)
        free = self.held if start is None else self.held[:start]
        if free:  # prose before any call: sent as it comes
            deltas.append({"content": free})
            self.held = self.held[len(free):]
        if final and self.held:
            content, calls = self.answer.format.parse(self.held, self.answer.tools)
            if content:
                deltas.append({"content": content})
            if calls:
                deltas.append({"tool_calls": [c.openai(self.n_calls + i) for i, c in enumerate(calls)]})
                self.n_calls += len(calls)
            self.held = ""
        return deltas


class Chat:
    """The served model's chat format: its template, tool-call family and reasoning markup."""

    def __init__(self, template: ChatTemplate, vocab, builtin_render) -> None:
        self.template, self.vocab = template, vocab
        # llama.cpp renders its built-in templates (named, not Jinja): messages -> text
        self._builtin_render = builtin_render
        format = ToolFormat.detect(template.source) if template.is_jinja else Generic()
        format.literal = self.lark  # its markers' control tokens named as tokens in its grammars
        self.format = format
        markup = markup_of(template.source) if template.is_jinja else None
        markers = [m for m in (*format.markers, *((markup.open, markup.close, *markup.headers) if markup else ())) if m]
        # llama.cpp renders a control token as nothing: an answer read back for its calls or its
        # thought shows these
        self.shown = tuple(sorted({t for marker in markers for t in self._specials(marker).values()}))

    def check(self) -> None:
        """Raises ChatTemplateError (a Jinja template that does not parse) or ModelError (a name
        that is none of llama.cpp's built-ins)."""
        if self.template.is_jinja:
            self.template.compiled()
        else:
            self._builtin_render([{"role": "user", "content": "hi"}])

    def _specials(self, text: str) -> dict[str, int]:
        """The control tokens in a marker's text (those that render as nothing), by their text."""
        ids = self.vocab.tokenize(text, add_special=False)
        return {self.vocab.text(t) or "": t for t in ids if not self.vocab.piece(t) and self.vocab.text(t)}

    def lark(self, text: str) -> str:
        """A marker as a Lark sequence: its text, any control token in it named as that token."""
        specials = self._specials(text)
        if not specials:
            return json.dumps(text)
        pieces = re.split("(" + "|".join(map(re.escape, specials)) + ")", text)
        return " ".join(f"<[{specials[p]}]>" if p in specials else json.dumps(p) for p in pieces if p)

    def adds_bos(self, text: str) -> bool:
        """Whether the tokenizer adds its BOS to a rendered prompt: not where the template wrote
        it itself (Llama 3, Mistral), so that there is no second one."""
        bos = self.template.bos_token
        return not (bos and text.startswith(bos))

    def prompt(
        self, messages: list[dict], tools: Tools | None = None, template_kwargs: dict | None = None, reasoning_budget: int = -1,
    ) -> ChatPrompt:
        """The prompt for OpenAI-shaped messages (tool calls and results included), and how its
        answer is held and read. `reasoning_budget`: the thought's tokens at most (-1: no limit,
        0: thinking off, as llama-server's --reasoning-budget). Raises ChatTemplateError when the
        template cannot render them."""
        if reasoning_budget == 0:
            template_kwargs = {"enable_thinking": False, **(template_kwargs or {})}
        format = self.format if tools is not None else None
        shown = [_for_template(m, format) for m in messages]
        if tools is not None and not format.renders_tools and tools.constrained:
            shown = _with_system(shown, format.system_prompt(tools))
        if self.template.is_jinja:
            jinja_tools = [{"type": "function", "function": _function(t)} for t in tools.tools] if tools and format.renders_tools else None
            # thinking on unless the request turns it off, as llama-server renders (templates that
            # read enable_thinking differ in their default when it is left undefined)
            text = self.template.render(shown, tools=jinja_tools, **{"enable_thinking": True, **(template_kwargs or {})})
        else:
            text = self._builtin_render([{"role": m["role"], "content": m.get("content") or ""} for m in shown])
        reasoning = Reasoning.of(self.template.source, text) if self.template.is_jinja else None
        if reasoning is not None and reasoning.open and reasoning_budget == 0:
            # a template that opens the thought whatever it is told (DeepSeek R1's, MiniMax M2's):
            # closed in the prompt, as DeepSeek R1 Distill Qwen's own template closes it
            text, reasoning = f"{text}{reasoning.markup.closing.lstrip()}", None
        lark = format.grammar(tools) if tools is not None and tools.constrained else None
        if lark is not None and reasoning is not None and tools.required:
            lark = self._after_thought(lark, reasoning)
        tokens = self.vocab.tokenize(text, add_special=self.adds_bos(text))
        # (budget 0 with a thought the model may still open: closed as soon as it opens)
        budget = (ThinkingBudget(reasoning_budget, opened=reasoning.open, markup=reasoning.markup)
                  if reasoning is not None and reasoning_budget >= 0 else None)
        # (only an answer that is read back takes the engine's general path to show them)
        shown = self.shown if lark is not None or reasoning is not None else ()
        return ChatPrompt(text, tokens, lark, Answer(tools, format, reasoning), budget, shown)

    def _after_thought(self, lark: str, reasoning: Reasoning) -> str:
        """Calls required from a thinking model's first token would forbid its thought: let it think first."""
        head, _, rest = lark.partition("\n")
        markup = reasoning.markup
        # at most a few blank characters after it (an unbounded run is a loop a small model falls
        # into), then what comes between a thought and the answer (gpt-oss: a message header)
        after = "/[ \\n]{0,4}/" + (f" {self.lark(markup.between)}" if markup.between else "")
        if self._specials(markup.close):  # a control token: no text matches it, so none can run past it
            body = f"thought: /(.|\\n)*/ {self.lark(markup.close)}"
        else:
            body = f"thought[stop={json.dumps(markup.close)}]: /(.|\\n)*/"
        thought = f"thought {after}" if reasoning.open else f"({self.lark(markup.open)} thought {after})?"
        return f'start: {thought} answer\nanswer: {head.removeprefix("start: ")}\n{body}\n{rest}'


def _function(tool) -> dict:
    # templates read tool.description unguarded (Hermes 3's): one that has none gets an empty one
    return {"name": tool.name, "description": tool.description or "", "parameters": tool.parameters}


def _for_template(message: dict, format: ToolFormat | None) -> dict:
    """A message as templates read it: tool call arguments as objects (Hugging Face's convention),
    and a call's content "" where the client sent none (templates test it as text, as llama.cpp
    gives it them); for the generic family, calls and results written out as the JSON the model
    answers in."""
    shown = dict(message)
    calls = shown.get("tool_calls")
    if calls:
        shown["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}} for c in calls]
        if shown.get("content") is None:
            shown["content"] = ""
    if isinstance(format, Generic):
        if calls:
            written = [{"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])} for c in calls]
            shown = {"role": "assistant", "content": json.dumps({"tool_calls": written}, ensure_ascii=False)}
        elif shown["role"] == "tool":
            result = {"tool_call_id": shown.get("tool_call_id"), "content": shown.get("content")}
            shown = {"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False)}
    return shown


def _arguments(text):
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


__all__ = ["Answer", "AnswerStream", "Chat", "ChatPrompt"]
