"""Sampling a step: each due sequence's next token from its row of the step's logits."""

from __future__ import annotations

from collections import Counter

import numpy as np

from .constraints import Grammars
from .sampling import token_logprob
from .sequence import Sequence
from .truncation import Scratch

# What pick() gives a sequence: its token; None when nothing is drawn for it here (it verifies
# drafts, or asked for no tokens); the exception its sampler raised.
Pick = int | None | Exception


class Picker:
    """Greedy rows from one argmax over all rows, the others by their own samplers
    (sampling.RowSampler, chain.ChainSampler), constrained rows after their masks, with the
    log-probabilities asked for beside."""

    def __init__(self, grammars: Grammars, scratch: Scratch) -> None:
        self.grammars, self.scratch = grammars, scratch

    def pick(self, due: list[Sequence], rows: list[int] | range, logits: np.ndarray) -> list[Pick]:
        """due[k]'s pick from row rows[k]. A sampler that fails fails its own pick only."""
        # Followers sampling from their leader's row share it (never in a plain step: rows is a range).
        shared = set() if isinstance(rows, range) else {r for r, k in Counter(rows).items() if k > 1}
        raw = self._mask_constrained(due, rows, shared, logits)
        best = logits.argmax(axis=1).tolist() if any(s.sampler.greedy for s in due) else None
        # Plain greedy rows (most of them, most steps) inline; any other row goes through _pick.
        return [
            best[r] if seq.sampler.greedy and not (seq.special or seq.draft) else self._pick(seq, r, shared, best, raw, logits)
            for seq, r in zip(due, rows)
        ]

    def _pick(self, seq: Sequence, r: int, shared: set[int], best: list[int] | None,
              raw: dict[int, np.ndarray], logits: np.ndarray) -> Pick:
        try:
            if seq.special or seq.draft:
                return self._pick_special(seq, r, shared, best, raw, logits)
            return seq.sampler.sample(logits[r], seq.tokens, self.scratch)
        except Exception as e:  # noqa: BLE001 - its failure, not its neighbours'
            return e

    def _pick_special(self, seq: Sequence, r: int, shared: set[int], best: list[int] | None,
                      raw: dict[int, np.ndarray], logits: np.ndarray) -> int | None:
        if seq.params.max_tokens == 0 or seq.draft:
            return None
        if seq.forced:  # a thought closed for it: the close is written, whatever the row says
            token = seq.forced.pop(0)
        elif seq.matcher is not None and r in shared:
            token = self._sample_masked_copy(seq, logits[r])
        else:
            token = best[r] if seq.sampler.greedy else seq.sampler.sample(logits[r], seq.tokens, self.scratch)
        if seq.params.logprobs is not None:  # the model's own distribution, before any mask
            seq.logprobs.append(token_logprob(raw.get(seq.uid, logits[r]), token, seq.params.logprobs))
        return token

    def _mask_constrained(self, due: list[Sequence], rows: list[int] | range, shared: set[int], logits: np.ndarray) -> dict[int, np.ndarray]:
        """Mask, in place and together, the rows of constrained sequences that sample alone from
        them; returns unmasked copies of those whose log-probabilities are reported."""
        alone = [(seq, r) for seq, r in zip(due, rows) if seq.matcher is not None and r not in shared and seq.params.max_tokens]
        raw = {seq.uid: logits[r].copy() for seq, r in alone if seq.params.logprobs is not None}
        if alone:
            self.grammars.mask_rows([seq.matcher for seq, _ in alone], [logits[r] for _, r in alone])
        return raw

    def _sample_masked_copy(self, seq: Sequence, row: np.ndarray) -> int:
        """A constrained sequence sampling from a row others sample from too: mask it, sample, and
        put it back as it was for them."""
        original = row.copy()
        self.grammars.mask_rows([seq.matcher], [row])
        try:
            return int(row.argmax()) if seq.sampler.greedy else seq.sampler.sample(row, seq.tokens, self.scratch)
        finally:
            row[:] = original
