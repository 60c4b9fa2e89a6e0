"""Reasoning models' thinking, apart from their answer: `<think>…</think>` (Qwen3, QwQ, DeepSeek R1
and their distills), returned as `reasoning_content`, whole or streamed."""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkingBudget:
    """A thought closed for the model after `tokens` tokens (the engine writes the close:
    engine.thinking); llama-server's --reasoning-budget."""

    tokens: int  # the thought's tokens at most; then the close is written
    opened: bool = False  # the prompt opened the thought (the answer starts inside it)
    open: str = OPEN
    close: str = CLOSE


@dataclass(frozen=True)
class Reasoning:
    """How one answer's thinking is marked. `open` is True when the prompt itself opened the
    thought (templates that end their generation prompt with <think>), so the answer starts inside it."""

    open: bool = False

    @staticmethod
    def of(template_source: str, prompt: str) -> Reasoning | None:
        """None for a template without thinking markup, or a prompt that closed the thought itself
        (thinking turned off: Qwen3's enable_thinking=false writes an empty one)."""
        tail = prompt.rstrip()
        if OPEN not in template_source or CLOSE not in template_source or tail.endswith(CLOSE):
            return None
        return Reasoning(open=tail.endswith(OPEN))

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
        self.state = "thinking" if reasoning.open else "start"  # start: the answer's first characters may open a thought
        self.held = ""

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) text that this piece makes certain."""
        text, self.held = self.held + piece, ""
        thought = answer = ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    self.state, text = "thinking", stripped[len(OPEN):]
                elif OPEN.startswith(stripped) and not final:
                    self.held, text = text, ""
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                end = text.find(CLOSE)
                if end >= 0:
                    thought += text[:end]
                    self.state, text = "after", text[end + len(CLOSE):]
                    continue
                keep = 0 if final else _partial_suffix(text, CLOSE)
                thought, self.held, text = thought + text[: len(text) - keep], text[len(text) - keep:], ""
            elif self.state == "after":  # the answer starts after the blank lines that follow a thought
                text = text.lstrip()
                if text:
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
