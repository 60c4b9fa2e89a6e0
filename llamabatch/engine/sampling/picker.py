"""Sampling a step: each due sequence's next token from its row of the step's logits."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .constraints import Grammars
from .samplers import token_logprob
from ..sequence import Sequence
from .truncation import Scratch

# What pick() gives a sequence: its token; None when nothing is drawn for it here (it verifies
# drafts, or asked for no tokens); the exception its sampler raised.
Pick = int | None | Exception
_LATER = object()  # a sampled row's place in the picks until its draw is made

# Sampled rows are shared out between threads, each with at least this many: a draw is mostly
# numpy passes over the row, which leave the GIL. On a CPU build the other threads find their
# cores free only because llama.cpp's OpenMP threads sleep soon after a decode (llamabatch.openmp).
MIN_ROWS_A_THREAD = 4


class Picker:
    """Greedy rows from one argmax over all rows, the others by their own samplers
    (sampling.RowSampler, chain.ChainSampler) on up to `n_threads` threads, constrained rows
    after their masks, with the log-probabilities asked for beside. close() stops the threads."""

    def __init__(self, grammars: Grammars, scratch: Scratch, n_threads: int = 1) -> None:
        self.grammars, self.scratch = grammars, scratch
        self.n_threads = max(1, n_threads)
        # Scratch buffers a thread each (the caller's first); a row's sampler is its own.
        self._scratches = [scratch, *(Scratch(len(scratch.values)) for _ in range(self.n_threads - 1))]
        self._pool = ThreadPoolExecutor(self.n_threads - 1, "llamabatch-sampling") if self.n_threads > 1 else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def pick(self, due: list[Sequence], rows: list[int] | None, logits: np.ndarray, draws: bool = True,
             special: bool = True) -> list[Pick]:
        """due[k]'s pick from row rows[k] (rows None: from row k, as a plain step lays them out).
        `draws` and `special`: whether any may draw, and whether any is sampled otherwise than by
        its sampler alone (Sequence.special); False spares a plain greedy step its passes over the
        rows. A sampler that fails fails its own pick only."""
        if rows is None:
            if not (draws or special):  # each row plain greedy
                return logits.argmax(axis=1).tolist()
            rows = range(len(due))
        return self._pick_each(due, rows, logits, draws)

    def _pick_each(self, due: list[Sequence], rows: list[int] | range, logits: np.ndarray, draws: bool) -> list[Pick]:
        """pick(), row by row. (Apart from pick: its comprehensions make cells of its locals, which
        every call would build, a plain greedy step's included.)"""
        # Followers sampling from their leader's row share it (never in a plain step: rows is a range).
        shared = set() if isinstance(rows, range) else {r for r, k in Counter(rows).items() if k > 1}
        raw = self._mask_constrained(due, rows, shared, logits)
        best = logits.argmax(axis=1).tolist() if any(s.sampler.greedy for s in due) else None
        # Plain greedy rows (most of them, most steps) inline; plain sampled ones drawn together
        # below; any other row (constrained, drafting, with log-probabilities) through _pick_special.
        picks = [
            (best[r] if seq.sampler.greedy else _LATER) if not (seq.special or seq.draft)
            else self._pick_special(seq, r, shared, best, raw, logits)
            for seq, r in zip(due, rows)
        ]
        if draws:
            sampled = [(seq, logits[r], k) for k, (seq, r, p) in enumerate(zip(due, rows, picks)) if p is _LATER]
            if sampled:
                self._draw(sampled, picks)
        return picks

    def _draw(self, sampled: list[tuple[Sequence, np.ndarray, int]], picks: list[Pick]) -> None:
        """Each sampled row's draw into picks, the rows shared out between the threads. A draw
        depends only on its row and its own sampler, so the threads change no token."""
        n = min(self.n_threads, len(sampled) // MIN_ROWS_A_THREAD) or 1
        shares = [sampled[i::n] for i in range(n)]
        waiting = [self._pool.submit(_draw_share, share, scratch, picks) for share, scratch in zip(shares[1:], self._scratches[1:])]
        _draw_share(shares[0], self.scratch, picks)
        for done in waiting:
            done.result()

    def _pick_special(self, seq: Sequence, r: int, shared: set[int], best: list[int] | None,
                      raw: dict[int, np.ndarray], logits: np.ndarray) -> Pick:
        try:
            return self._special(seq, r, shared, best, raw, logits)
        except Exception as e:  # noqa: BLE001 - its failure, not its neighbours'
            return e

    def _special(self, seq: Sequence, r: int, shared: set[int], best: list[int] | None,
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


def _draw_share(share: list[tuple[Sequence, np.ndarray, int]], scratch: Scratch, picks: list[Pick]) -> None:
    for seq, row, k in share:
        try:
            picks[k] = seq.sampler.sample(row, seq.tokens, scratch)
        except Exception as e:  # noqa: BLE001 - its failure, not its neighbours'
            picks[k] = e
