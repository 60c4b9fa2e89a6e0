"""Reasoning models' thinking, apart from their answer, returned as `reasoning_content` (whole or
streamed). Each template family marks a thought its own way (Markup): `<think>…</think>` (Qwen3,
QwQ, DeepSeek R1 and most others), gpt-oss's analysis channel, Seed-OSS's, Magistral's,
Command R7B's, Gemma 4's, Solar Open's and Apriel's tags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Markup:
    """How a template family marks a thought: the tag that opens it and the one that closes it,
    what is written to close one for the model (a thinking budget's end, a prompt that turns
    thinking off), and the headers that may open the answer, after a thought or without one (cut
    from the answer: gpt-oss's final channel)."""

    open: str
    close: str
    closing: str
    headers: tuple[str, ...] = ()

    def marks(self, source: str) -> bool:
        # (a template's Jinja source writes a newline as the two characters \n)
        return self.open.strip() in source and self.close.strip() in source

    @property
    def between(self) -> str:
        """What the model writes after a thought's close before its answer (gpt-oss: a new
        message's header): the closing without the close tag and blank characters."""
        return self.closing.strip().removeprefix(self.close.strip()).strip()


THINK = Markup("<think>", "</think>", "\n</think>\n\n")
MARKUPS = (  # the first whose tags a template holds is its own; <think> last, as others may mention it
    Markup("<|channel|>analysis<|message|>", "<|end|>", "<|end|><|start|>assistant",
           ("<|start|>assistant", "<|channel|>final<|message|>")),  # gpt-oss: the analysis channel, then the final one
    Markup("<seed:think>", "</seed:think>", "\n</seed:think>\n\n"),  # Seed-OSS
    Markup("[THINK]", "[/THINK]", "[/THINK]"),  # Magistral, Ministral reasoning
    Markup("<|START_THINKING|>", "<|END_THINKING|>", "<|END_THINKING|>", ("<|START_RESPONSE|>",)),  # Command R7B, Command A
    Markup("<|channel>thought\n", "<channel|>", "<channel|>"),  # Gemma 4
    Markup("<|think|>", "<|end|>", "<|end|><|begin|>assistant", ("<|begin|>assistant", "<|content|>")),  # Solar Open
    Markup("Here are my reasoning steps:\n", "[BEGIN FINAL RESPONSE]", "\n[BEGIN FINAL RESPONSE]\n"),  # Apriel 1.6
    THINK,
)


def markup_of(template_source: str) -> Markup | None:
    return next((m for m in MARKUPS if m.marks(template_source)), None)


@dataclass(frozen=True)
class ThinkingBudget:
    """A thought closed for the model after `tokens` tokens (the engine writes the markup's
    closing: engine.thinking); llama-server's --reasoning-budget."""

    tokens: int  # the thought's tokens at most; then the close is written
    opened: bool = False  # the prompt opened the thought (the answer starts inside it)
    markup: Markup = THINK


@dataclass(frozen=True)
class Reasoning:
    """How one answer's thinking is marked. `open` is True when the prompt itself opened the
    thought (templates that end their generation prompt with its opening tag), so the answer
    starts inside it."""

    open: bool = False
    markup: Markup = THINK

    @staticmethod
    def of(template_source: str, prompt: str) -> Reasoning | None:
        """None for a template without thinking markup, or a prompt that closed the thought itself
        (thinking turned off: Qwen3's enable_thinking=false writes an empty one)."""
        markup = markup_of(template_source)
        tail = prompt.rstrip()
        if markup is None or tail.endswith(markup.close.strip()):
            return None
        return Reasoning(open=tail.endswith(markup.open.strip()), markup=markup)

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of a whole answer: what its stream would send, joined. A thought
        never closed (cut by max_tokens) is all reasoning."""
        return self.streamed().feed(text, final=True)

    def streamed(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """Splits a stream of text pieces into reasoning and answer deltas, holding back a piece
    that may be the start of a tag until the next one says whether it is."""

    def __init__(self, reasoning: Reasoning) -> None:
        self.markup = reasoning.markup
        self.state = "thinking" if reasoning.open else "start"  # start: the answer's first characters may open a thought
        self.held = ""

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) text that this piece makes certain."""
        text, self.held = self.held + piece, ""
        thought = answer = ""
        markup = self.markup
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(markup.open):
                    self.state, text = "thinking", stripped[len(markup.open):]
                elif markup.open.startswith(stripped) and not final:
                    self.held, text = text, ""
                else:
                    self.state = "after" if markup.headers else "answer"
            elif self.state == "thinking":
                end = text.find(markup.close)
                if end >= 0:
                    thought += text[:end]
                    self.state, text = "after", text[end + len(markup.close):]
                    continue
                keep = 0 if final else _partial_suffix(text, markup.close)
                thought, self.held, text = thought + text[: len(text) - keep], text[len(text) - keep:], ""
            elif self.state == "after":  # the answer starts after the blank lines (and headers) that follow a thought
                text = text.lstrip()
                header = next((h for h in markup.headers if text.startswith(h)), None)
                if header is not None:
                    text = text[len(header):]
                elif text and any(h.startswith(text) for h in markup.headers) and not final:
                    self.held, text = text, ""
                elif text:
                    self.state = "answer"
            else:
                answer, text = answer + text, ""
        return thought, answer


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of text could begin the tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
