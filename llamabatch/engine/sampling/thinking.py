"""A thinking budget: a reasoning model's thought is closed for it after so many tokens, as
llama-server's --reasoning-budget closes it, by writing its markup's closing as the model's
next tokens. The thought is found by its tags in the generated text (or opened by the prompt)."""

from __future__ import annotations

import codecs

from ...chat.reasoning import ThinkingBudget


class Thought:
    """One sequence's thought, watched token by token until it closes or runs out of budget."""

    def __init__(self, budget: ThinkingBudget, close_tokens: list[int]) -> None:
        self.budget, self.close_tokens = budget, close_tokens
        self.inside = budget.opened
        self.done = False
        self.n = 0
        self._text = ""  # recent text: where a tag may be split across tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character split across tokens

    def after(self, piece: bytes) -> list[int] | None:
        """The tokens to write next, once this piece takes the thought to its budget; else None."""
        if self.done:
            return None
        self._text = (self._text + self._utf8.decode(piece))[-64:]
        if not self.inside:
            head = self._text.lstrip()
            if head.startswith(self.budget.markup.open):
                self.inside, self._text = True, head[len(self.budget.markup.open):]
                if self.budget.tokens == 0:  # no thought at all: closed as it opens
                    self.done = True
                    return self.close_tokens
            elif head and not self.budget.markup.open.startswith(head):
                self.done = True  # the answer did not open with a thought: nothing to close
            return None
        if self.budget.markup.close in self._text:
            self.done = True
            return None
        self.n += 1
        # at the budget, closed between two characters (never inside one: the text must stay UTF-8)
        if self.n >= self.budget.tokens and not self._utf8.getstate()[0]:
            self.done = True
            return self.close_tokens
        return None
