"""Speculative decoding by n-gram prompt lookup: a sequence whose last few tokens appeared before
(in its prompt or its output) proposes the tokens that followed them there; the engine verifies
those drafts in the same llama_decode as every other row, and keeps the run the model agrees with.

Drafts cost no model, but every draft row costs decode time (on a CPU with a 262k-token vocabulary
the output layer alone makes a row with logits expensive). `DraftPlanner` measures, per batch
size, whether steps with drafts give more tokens per second than steps without, and drafts only
where they do; so turning speculation on costs next to nothing where it cannot help.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sampling import SamplingParams, build_truncation

NGRAM_SIZES = (4, 3, 2)  # longest match first: a longer context predicts better
PRIOR_ACCEPTANCE = 0.8  # the acceptance rate before any verification: optimistic, so drafts get tried
ACCEPTANCE_MEMORY = 0.8  # weight of the past in a sequence's acceptance rate
POOLED_MEMORY = 0.9  # and in the rate over all sequences (the last ten or so verifications): a new sequence starts there
LOW_ACCEPTANCE = 0.3  # below this, a sequence drafts one token at a time
SMALL_BATCH_BUCKET = 3  # batches of up to 7 sequences try drafts first-hand; larger ones after a smaller one won
TRIES = 8  # steps with and without drafts measured, per batch size, before choosing
EXPLORE = 0.03  # share of steps, once chosen, that try the other way
RATE_MEMORY = 0.98  # weight of each earlier step in a way's measured tokens per second


@dataclass
class NgramLookup:
    """One sequence's index of where each n-gram of its tokens last ended, and how often its
    drafts have been kept lately."""

    acceptance: float = PRIOR_ACCEPTANCE  # chance that a draft token is kept, given the ones before it were
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

    def record(self, drafted: int, accepted: int) -> None:
        self.acceptance = _updated(self.acceptance, drafted, accepted, ACCEPTANCE_MEMORY)


def _updated(rate: float, drafted: int, accepted: int, memory: float) -> float:
    """Each draft position tried until the first refusal is one trial of the acceptance rate."""
    trials = accepted + (accepted < drafted)
    return memory * rate + (1 - memory) * accepted / trials


class DraftPlanner:
    """Whether the sequences of a step draft, decided by measuring. What a draft row costs is
    far from linear in rows and differs by machine (on this project's CPU with Gemma 3 a step of
    two rows takes 2.5 times one row, nine rows 4.5 times; on a GPU extra rows are nearly free),
    and how often drafts are kept differs by workload, so no model of either is assumed. For
    each batch size (in powers of two) the planner keeps the tokens per second of steps with
    drafts and of steps without, tries both a few times, then takes the faster and now and then
    the other. A larger batch tries drafts only if the next smaller one found them faster:
    drafts pay less as batches grow, and trying them in a large batch is what costs most."""

    def __init__(self, draft_max: int, seed: int = 0) -> None:
        self.draft_max = draft_max
        self.acceptance = PRIOR_ACCEPTANCE  # over all sequences: where a new one starts
        # (batch-size bucket, drafting) -> its steps' tokens and seconds, older steps weighing less
        self.totals: dict[tuple[int, bool], tuple[float, float]] = {}
        self.tries: dict[tuple[int, bool], int] = {}
        self.rng = np.random.default_rng(seed)
        self.chosen: tuple[int, bool] | None = None  # the arm of the step under way

    def lookup(self) -> NgramLookup:
        """A new sequence's lookup, guessing it will be kept as often as drafts have been lately."""
        return NgramLookup(acceptance=self.acceptance)

    def record(self, lookup: NgramLookup, drafted: int, accepted: int) -> None:
        lookup.record(drafted, accepted)
        self.acceptance = _updated(self.acceptance, drafted, accepted, POOLED_MEMORY)

    def plan(self, n_rows: int, lookups: list[NgramLookup]) -> list[int]:
        """Draft lengths for `lookups`' sequences in a step of n_rows generating sequences; a
        sequence whose drafts are seldom kept brings one token at most."""
        bucket = n_rows.bit_length()
        drafting = self._choose(bucket)
        self.chosen = (bucket, drafting)
        if not drafting:
            return [0] * len(lookups)
        return [self.draft_max if lk.acceptance >= LOW_ACCEPTANCE else 1 for lk in lookups]

    def _choose(self, bucket: int) -> bool:
        may_draft = bucket <= SMALL_BATCH_BUCKET or self.faster(bucket - 1)
        if not may_draft:
            return False
        for arm in (True, False):
            if self.tries.get((bucket, arm), 0) < TRIES:
                return arm
        best = self.faster(bucket)
        return (not best) if self.rng.random() < EXPLORE else best

    def faster(self, bucket: int) -> bool:
        """Whether steps with drafts have been faster than steps without, at this batch size."""
        if min(self.tries.get((bucket, True), 0), self.tries.get((bucket, False), 0)) < TRIES:
            return False
        return self.rate(bucket, True) > self.rate(bucket, False)

    def observe(self, drafted: bool, tokens: int, seconds: float) -> None:
        """The step planned last made `tokens` in `seconds`; with no draft found it counts as one without."""
        if self.chosen is None or seconds <= 0:
            return
        arm = (self.chosen[0], drafted)
        self.chosen = None
        self.tries[arm] = self.tries.get(arm, 0) + 1
        old_tokens, old_seconds = self.totals.get(arm, (0.0, 0.0))
        self.totals[arm] = (RATE_MEMORY * old_tokens + tokens, RATE_MEMORY * old_seconds + seconds)

    def rate(self, bucket: int, drafting: bool) -> float:
        """Tokens per second of such steps (a ratio of sums: a step that kept a long draft and
        one that kept none weigh by their time, as in a real run)."""
        tokens, seconds = self.totals[bucket, drafting]
        return tokens / seconds


class DraftSampler:
    """Verifies a sampled sequence's drafts by rejection sampling, so its tokens keep exactly the
    distribution of sampling them one step at a time: a draft token d (proposed with certainty)
    is kept with probability p(d); at the first one refused, the token is drawn from p with d
    taken out; when all are kept, one more is drawn from the last row. p is what the sequence's
    own truncation and temperature leave (llama.cpp's samplers, applied without the draw).
    Its own seeded generator draws, so a seed gives other tokens than without speculation."""

    def __init__(self, params: SamplingParams) -> None:
        self.truncation = build_truncation(params)
        self.rng = np.random.default_rng(params.seed)

    def verify(self, rows: np.ndarray, draft: list[int]) -> tuple[list[int], int]:
        """(the tokens to accept, how many of them are drafts); rows[j] predicts draft[j]."""
        for j, proposed in enumerate(draft):
            ids, probs = self.truncation.distribution(rows[j])
            at = np.flatnonzero(ids == proposed)
            p = float(probs[at[0]]) if at.size else 0.0
            if self.rng.random() < p:
                continue
            probs = probs.copy()
            probs[at] = 0.0  # the residual max(p - q, 0), q putting all its mass on the draft
            return draft[:j] + [int(self.rng.choice(ids, p=probs / probs.sum()))], j
        ids, probs = self.truncation.distribution(rows[len(draft)])
        return draft + [int(self.rng.choice(ids, p=probs))], len(draft)

    def close(self) -> None:
        self.truncation.close()
