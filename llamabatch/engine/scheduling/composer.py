"""What each step carries: every decoding sequence's next token, then prompt chunks within the
step's budget (n_batch tokens, and beside decoders a time budget: StepBudget), shared out so that
every prompt being read progresses; one adapter set a step, cut where checkpoints and the logits
budget say."""

from __future__ import annotations

import operator
from collections import Counter

from ..adapters import AdapterSet
from ..sequence import Sequence
from ..step import Step
from .budget import StepBudget, shares
from .leaders import Leaders

_by_seq_id = operator.attrgetter("seq_id")


class Composer:
    """Composes steps from the running sequences; its state is the adapter sets' turns and, in
    deterministic mode, the prompt tokens prefilled since the last decode step."""

    def __init__(self, n_batch: int, max_outputs: int, policy: str, deterministic: bool, checkpoint_every: int | None,
                 budget: StepBudget | None = None) -> None:
        self.n_batch, self.max_outputs, self.policy = n_batch, max_outputs, policy
        self.deterministic, self.checkpoint_every = deterministic, checkpoint_every
        self.budget = budget or StepBudget()
        self._prefilled_since_decode = 0  # prompt tokens; deterministic mode
        # LoRA adapter sets take turns (llama.cpp decodes one set per step): the step each last had.
        self._turn = 0
        self._last_turn: dict[AdapterSet, int] = {}

    def compose(self, running: list[Sequence], leaders: Leaders, reserved: int, draws: bool, special: bool,
                media: int = 0) -> tuple[Step, bool]:
        """The step, and whether it repeats as it is until a sequence joins or leaves (plain, and
        not one adapter set's turn among several). `reserved` rows (speculative drafts, which
        also want logits) are kept out of the budget; `media`: image positions this step has
        read already, which the time budget counts as prompt tokens; `draws` and `special` go
        on the step."""
        generating, prefilling = [], []
        plain = not reserved  # so far every row decodes a sampled token
        first = running[0].adapters if running else ()
        mixed = False  # sequences under different adapter sets
        for seq in running:  # one pass, no properties: this runs every step it is not repeated
            if seq.adapters is not first and seq.adapters != first:
                mixed = True
            if len(seq.tokens) - seq.n_past > 1:
                if seq.leader is None:
                    prefilling.append(seq)
            elif seq.leader is None:
                generating.append(seq)
                if seq.n_past <= seq.n_prompt:  # its prompt is in, or its last token goes in now
                    leaders.retire(seq)
                    if seq.n_past < seq.n_prompt:  # that last token's row may score it, or hand on a prefix
                        plain = False
        # A prompt that brings no chunk this step (its next positions are an image's, read apart)
        # still has one to come: the step is not repeated as it is.
        reading = bool(prefilling)
        if mixed:
            generating, prefilling = self._one_adapter_set(generating, prefilling)
        if self.deterministic:
            return self._isolated(generating, prefilling, draws, special), False
        if prefilling and self.policy == "priority":
            generating, prefilling = _held_back(generating, prefilling)
        chunks = dict.fromkeys(generating, 1)
        checkpoints = self._read_prompts(prefilling, generating, reserved, media, chunks) if prefilling else frozenset()
        plain = plain and len(chunks) == len(generating)
        return _step(chunks, plain, draws, special, checkpoints, len(generating)), plain and not mixed and not reading

    def _read_prompts(self, prefilling: list[Sequence], generating: list[Sequence], reserved: int, media: int,
                      chunks: dict[Sequence, int]) -> frozenset[int]:
        """Each prompt's chunk into `chunks`, within the step's budget (in time beside streamed
        decoders, less the image positions read beside them): shared out while the step budget
        is on, else the oldest first, each all it wants. Returns the uids of the rows whose chunk
        ends at a checkpoint."""
        n_decoding, streamed = len(generating), sum(seq.streamed for seq in generating)
        budget = self.budget.prompt_tokens(streamed, self.n_batch - n_decoding - reserved)
        if self.budget.on and streamed:
            budget = max(0, budget - media)
        outputs = n_decoding + reserved
        wants = [_want(seq) for seq in prefilling]
        shared = shares(wants, budget) if self.budget.on else None
        checkpoints = set()
        for k, seq in enumerate(prefilling):
            n = self._fit_outputs(seq, shared[k] if shared is not None else min(wants[k], budget), outputs)
            if n == 0:
                continue
            if shared is None:
                budget -= n
            chunks[seq], checkpoint = self._stop_at_checkpoint(seq, n)
            if checkpoint:
                checkpoints.add(seq.uid)
            outputs += len(seq.scored_rows(seq.n_past, n)) + 1
        return frozenset(checkpoints)

    def _one_adapter_set(self, generating: list[Sequence], prefilling: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """The rows of one adapter set: the set whose sequences have waited longest, weighted by
        how many they are, so each sequence gets about the same share of steps whatever its set
        (a set of 6 beside a set of 2 runs 3 steps in 4), and none waits for ever."""
        sizes = Counter(seq.adapters for seq in generating + prefilling)
        if len(sizes) < 2:
            return generating, prefilling
        self._turn += 1
        chosen = max(sizes, key=lambda key: sizes[key] * (self._turn - self._last_turn.get(key, 0)))
        self._last_turn = {key: turn for key, turn in self._last_turn.items() if key in sizes}
        self._last_turn[chosen] = self._turn
        return [s for s in generating if s.adapters == chosen], [s for s in prefilling if s.adapters == chosen]

    def _fit_outputs(self, seq: Sequence, n: int, outputs: int) -> int:
        """Shrink a scored prompt's chunk so its logits rows fit what the step has left of
        max_outputs (rows before its first scored one cost none)."""
        if seq.score_from < 0:
            return n
        free = max(0, seq.score_from - 1 - seq.n_past)
        return min(n, free + max(0, self.max_outputs - outputs))

    def _isolated(self, generating: list[Sequence], prefilling: list[Sequence], draws: bool, special: bool) -> Step:
        """Deterministic mode: one prompt's prefill alone, in the chunks a solo run uses; or every
        decode. As in a mixed step, decoders wait for at most n_batch prompt tokens between their steps."""
        if prefilling and (not generating or self._prefilled_since_decode < self.n_batch):
            seq = prefilling[0]
            n, checkpoint = self._stop_at_checkpoint(seq, max(1, self._fit_outputs(seq, min(seq.text_ahead if seq.media else seq.n_pending, self.n_batch), 0)))
            self._prefilled_since_decode += n
            return _step({seq: n}, False, draws, special, frozenset([seq.uid]) if checkpoint else frozenset(), 0)
        self._prefilled_since_decode = 0
        return _step(dict.fromkeys(generating, 1), False, draws, special, n_decoding=len(generating))

    def _stop_at_checkpoint(self, seq: Sequence, n: int) -> tuple[int, bool]:
        """A prompt chunk of up to n tokens, ended at the next checkpoint position of its prompt
        when memory needs checkpoints; and whether it ends at one."""
        if self.checkpoint_every is None or seq.n_past >= seq.n_prompt:
            return n, False
        stop = seq.n_prompt
        if seq.checkpoint_at > seq.n_past:
            stop = min(stop, seq.checkpoint_at)
        if self.checkpoint_every:
            stop = min(stop, (seq.n_past // self.checkpoint_every + 1) * self.checkpoint_every)
        if seq.n_past + n >= stop:
            return stop - seq.n_past, True
        return n, False


def _step(chunks: dict[Sequence, int], plain: bool, draws: bool, special: bool, checkpoints: frozenset[int] = frozenset(),
          n_decoding: int = 0) -> Step:
    rows = sorted(chunks, key=_by_seq_id)  # rows in seq_id order: see SlotPool
    sizes = [chunks[seq] for seq in rows]
    return Step(rows, sizes, plain, draws, special, checkpoints, n_decoding, sum(sizes) - n_decoding)


def _want(seq: Sequence) -> int:
    """The prompt tokens a prefilling sequence may take now: the rest of its prompt, up to its
    next image (read apart: Stepper._read_images) or where its followers wait for it to pause."""
    n = seq.text_ahead if seq.media else seq.n_pending
    cap = seq.prefix_cap
    return min(n, cap - seq.n_past) if cap else n


def _held_back(generating: list[Sequence], prefilling: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """The decoders and prompts that join a step prefilling the best priority's prompt: none of a
    worse priority. On a CPU each row lengthens the step, and the step is what a waiting
    request's first token waits for (Gemma 3 270M on 2 cores: 18 ms a step alone, 64 ms beside
    7 decoding batch sequences); they skip a step per such prompt chunk."""
    best = min(seq.priority for seq in prefilling)
    return [seq for seq in generating if seq.priority <= best], [seq for seq in prefilling if seq.priority <= best]
