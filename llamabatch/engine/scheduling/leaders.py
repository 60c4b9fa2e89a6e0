"""Prefix leaders: a sequence admitted while another still prefills the same prefix follows it,
waits, and gets the prefix copied once the leader has it, instead of decoding it again."""

from __future__ import annotations

from ..sequence import Sequence
from .prefix_index import PrefixIndex, worth_sharing


class Leaders:
    """Running sequences that have not sampled yet, filed by their prompts (once decoding, they
    hold their whole prompt and lead no one)."""

    def __init__(self) -> None:
        self._index: PrefixIndex[Sequence] = PrefixIndex(lambda seq: seq.tokens, lambda seq: seq.adapters)

    def follow(self, seq: Sequence, whole_only: bool) -> None:
        """Follow the running sequence still prefilling the longest prefix this one shares, then
        become a possible leader for later ones. `whole_only` (deterministic mode, where prefixes
        are not shared) follows only an identical prompt, as -n samples are: the follower samples
        from the row the leader's prefill computed, and its copied KV is that prefill's, so its
        arithmetic is a solo run's; a partial copy would change how the rest of its prompt is computed."""
        n_best = max(seq.n_past, 0)
        for n, other in self._index.matches(seq.tokens, seq.adapters):
            if whole_only and not n == len(seq.tokens) == len(other.tokens):
                continue
            if n == len(seq.tokens) and len(other.tokens) > n:
                n -= 1  # it must sample from the leader's logits, which exist only at its newest token
            n = min(n, seq.shareable)
            if n > n_best and n > other.n_past and n >= worth_sharing(seq):
                seq.follow(other, n)
                break
        if seq.n_generated == 0:  # until it samples, a prompt others can wait for
            self._index.add(seq)

    def retire(self, seq: Sequence) -> None:
        """It leads no one from now on (it decodes, or it left)."""
        if seq in self._index:
            self._index.remove(seq)
