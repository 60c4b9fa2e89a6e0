"""Rejection sampling: a sampled sequence's drafts verified so that its tokens keep the
distribution of drawing them one step at a time."""

from __future__ import annotations

import numpy as np

from ..sampling.params import SamplingParams
from ..sampling.truncation import Scratch, distribution


class DraftSampler:
    """Verifies a sampled sequence's drafts by rejection sampling, so its tokens keep exactly the
    distribution of sampling them one step at a time: a draft token d (proposed with certainty)
    is kept with probability p(d); at the first one refused, the token is drawn from p with d
    taken out; when all are kept, one more is drawn from the last row. p is what the sequence's
    own truncation and temperature leave (truncation.distribution, as its own draws use). It
    draws from the sequence's own generator (two generators of one seed would draw the same
    numbers, and a draft's test would follow the token before it), so a seed gives other tokens
    than without speculation."""

    def __init__(self, params: SamplingParams, rng: np.random.Generator) -> None:
        self.params = params
        self.rng = rng

    def verify(self, rows: np.ndarray, draft: list[int], scratch: Scratch) -> tuple[list[int], int]:
        """(the tokens to accept, how many of them are drafts); rows[j] predicts draft[j]."""
        for j, proposed in enumerate(draft):
            ids, probs = distribution(rows[j], self.params, scratch)
            at = np.flatnonzero(ids == proposed)
            p = float(probs[at[0]]) if at.size else 0.0
            if self.rng.random() < p:
                continue
            probs = probs.copy()
            probs[at] = 0.0  # the residual max(p - q, 0), q putting all its mass on the draft
            return draft[:j] + [int(self.rng.choice(ids, p=probs / probs.sum()))], j
        ids, probs = distribution(rows[len(draft)], self.params, scratch)
        return draft + [int(self.rng.choice(ids, p=probs))], len(draft)

    def close(self) -> None:
        pass  # owns nothing native
