"""Whether and how much sequences draft: each sequence's acceptance rate, and the planner.

Every draft row costs decode time (on a CPU with a 262k-token vocabulary the output layer alone
makes a row with logits expensive), and a draft model costs its own decodes. `DraftPlanner`
measures, per batch size, whether steps with drafts (their drafting included) give more tokens
per second than steps without, and drafts only where they do; so turning speculation on costs
next to nothing where it cannot help.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .ngrams import NgramIndex

PRIOR_ACCEPTANCE = 0.8  # the acceptance rate before any verification: optimistic, so drafts get tried
ACCEPTANCE_MEMORY = 0.8  # weight of the past in a sequence's acceptance rate
POOLED_MEMORY = 0.9  # and in the rate over all sequences (the last ten or so verifications): a new sequence starts there
MIN_REACH = 0.2  # a draft position is tried while the run before it is kept at least this often
SMALL_BATCH_BUCKET = 3  # batches of up to 7 sequences try drafts first-hand; larger ones after a smaller one won
TRIES = 8  # steps with and without drafts measured, per batch size, before choosing
CLEAR_TRIES = 2  # ... or this many, when one way is already more than CLEAR_MARGIN times faster
CLEAR_MARGIN = 2.0
EXPLORE = 0.03  # most share of the steps, and of the time, that try the other way once chosen
RATE_MEMORY = 0.98  # weight of each earlier step in a way's measured tokens per second


@dataclass
class DraftState:
    """One sequence's speculation: how often its drafts have been kept lately, and (n-gram
    drafting) the index its drafts come from."""

    acceptance: float = PRIOR_ACCEPTANCE  # chance that a draft token is kept, given the ones before it were
    ngrams: NgramIndex = field(default_factory=NgramIndex)  # filled only when drafts are looked up

    def record(self, drafted: int, accepted: int) -> None:
        self.acceptance = _updated(self.acceptance, drafted, accepted, ACCEPTANCE_MEMORY)


def draft_length(acceptance: float, draft_max: int) -> int:
    """Draft positions worth a row: those the whole draft so far reaches with a chance of at
    least MIN_REACH, given the sequence's acceptance rate (0.9 -> 15, 0.6 -> 3, 0.3 -> 1; at most draft_max)."""
    if acceptance >= 1.0:
        return draft_max
    reach = int(np.log(MIN_REACH) / np.log(max(acceptance, 1e-6)))
    return max(1, min(draft_max, reach))


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
    drafts and of steps without, tries both a few times (fewer when one is far ahead), then
    takes the faster and now and then the other, in at most EXPLORE of the steps and of the
    time: a step with a draft model's drafts can take twenty steps' time. A larger batch tries
    drafts only if the next smaller one found them faster: drafts pay less as batches grow, and
    trying them in a large batch is what costs most."""

    def __init__(self, draft_max: int, seed: int = 0) -> None:
        self.draft_max = draft_max
        self.acceptance = PRIOR_ACCEPTANCE  # over all sequences: where a new one starts
        # (batch-size bucket, drafting) -> its steps' tokens, seconds (setup left out), count and
        # seconds (all), older steps weighing less
        self.totals: dict[tuple[int, bool], tuple[float, ...]] = {}
        self.tries: dict[tuple[int, bool], int] = {}
        self.rng = np.random.default_rng(seed)
        self.chosen: tuple[int, bool] | None = None  # the arm of the step under way

    def state(self) -> DraftState:
        """A new sequence's state, guessing its drafts will be kept as often as drafts have been lately."""
        return DraftState(acceptance=self.acceptance)

    def record(self, state: DraftState, drafted: int, accepted: int) -> None:
        state.record(drafted, accepted)
        self.acceptance = _updated(self.acceptance, drafted, accepted, POOLED_MEMORY)

    def plan(self, n_rows: int, states: list[DraftState]) -> list[int]:
        """Draft lengths for `states`' sequences in a step of n_rows generating sequences, each
        from its own acceptance rate (draft_length)."""
        bucket = n_rows.bit_length()
        drafting = self._choose(bucket)
        self.chosen = (bucket, drafting)
        if not drafting:
            return [0] * len(states)
        return [draft_length(st.acceptance, self.draft_max) for st in states]

    def _choose(self, bucket: int) -> bool:
        may_draft = bucket <= SMALL_BATCH_BUCKET or self.faster(bucket - 1)
        if not may_draft:
            return False
        if not self._decided(bucket):
            return self.tries.get((bucket, True), 0) <= self.tries.get((bucket, False), 0)  # in turn
        best = self.rate(bucket, True) > self.rate(bucket, False)
        # Try the other way in at most EXPLORE of the steps and of the time, whatever its step costs.
        explore = EXPLORE * min(1.0, self.step_seconds(bucket, best) / self.step_seconds(bucket, not best))
        return (not best) if self.rng.random() < explore else best

    def _decided(self, bucket: int) -> bool:
        tries = min(self.tries.get((bucket, True), 0), self.tries.get((bucket, False), 0))
        if tries >= TRIES:
            return True
        if tries < CLEAR_TRIES:
            return False
        rates = self.rate(bucket, True), self.rate(bucket, False)
        return max(rates) > CLEAR_MARGIN * min(rates)

    def faster(self, bucket: int) -> bool:
        """Whether steps with drafts have been faster than steps without, at this batch size."""
        return self._decided(bucket) and self.rate(bucket, True) > self.rate(bucket, False)

    def observe(self, drafted: bool, tokens: int, seconds: float, setup: float = 0.0) -> None:
        """The step planned last made `tokens` in `seconds`, of which `setup` went on a
        once-a-sequence cost (a draft model's decode of new prompts): left out of the way's rate,
        counted in the time its tries take. With no draft found it counts as a step without."""
        if self.chosen is None or seconds <= 0:
            return
        arm = (self.chosen[0], drafted)
        self.chosen = None
        self.tries[arm] = self.tries.get(arm, 0) + 1
        new = (tokens, seconds - setup, 1, seconds)
        self.totals[arm] = tuple(RATE_MEMORY * a + b for a, b in zip(self.totals.get(arm, (0.0,) * 4), new))

    def rate(self, bucket: int, drafting: bool) -> float:
        """Tokens per second of such steps (a ratio of sums: a step that kept a long draft and
        one that kept none weigh by their time, as in a real run)."""
        tokens, seconds, _, _ = self.totals[bucket, drafting]
        return tokens / seconds

    def step_seconds(self, bucket: int, drafting: bool) -> float:
        """How long such a step takes, on average, setup included."""
        _, _, steps, seconds = self.totals[bucket, drafting]
        return seconds / steps
