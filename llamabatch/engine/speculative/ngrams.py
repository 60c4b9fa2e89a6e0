"""Prompt lookup: drafts from a sequence's own tokens, where its last few appeared before."""

from __future__ import annotations

from dataclasses import dataclass, field

NGRAM_SIZES = (4, 3, 2)  # longest match first: a longer context predicts better


@dataclass
class NgramIndex:
    """Where each n-gram of a sequence's tokens last ended: drafts from its own prompt and output."""

    indexed: int = 0  # tokens[:indexed] are in the index
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> index right after it

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix found."""
        self._index(tokens)
        n_tokens = len(tokens)
        for n in NGRAM_SIZES:
            if n_tokens <= n:
                continue
            end = self.last_end.get(tuple(tokens[n_tokens - n :]))
            if end is not None:
                return tokens[end : end + k]
        return []

    def _index(self, tokens: list[int]) -> None:
        # An n-gram enters the index once a token follows it (its end < len(tokens)), so a
        # lookup of the newest suffix finds an earlier occurrence, never itself.
        for end in range(max(self.indexed, 1), len(tokens)):
            for n in NGRAM_SIZES:
                if end >= n:
                    self.last_end[tuple(tokens[end - n : end])] = end
        self.indexed = len(tokens)
