"""The scheduler: who waits, who runs in which slot, and what the next step carries."""

from __future__ import annotations

import itertools

from ..sequence import Sequence, Status
from ..step import Step
from .budget import StepBudget
from .composer import Composer
from .fillers import LONE_ROW_MAX_CELLS, Filler, fillers
from .leaders import Leaders
from .queue import WaitingQueue, rank
from .slots import Slot, SlotPool


class Scheduler:
    """Owns the waiting queue, the running set and the slots.

    Waiting sequences are admitted best rank first (priority, aged by waiting time; see rank).
    When one waits with no slot free, running sequences of a worse rank make way for it
    (victims(): the engine keeps or frees their KV, then preempt()).

    Each step every running sequence that is generating brings its one new token,
    so generation never stalls behind a long prompt; prompt prefill fills the rest
    of the n_batch token budget, in admission order, in chunks (Composer).

    Prompt KV is shared two ways. A new sequence takes the free slot whose cached
    tokens share the longest prefix with it, keeping that prefix (else the lowest free
    seq_id, whose cache is overwritten: SlotPool). And a sequence admitted while another is
    still prefilling the same prefix follows it: it waits, and gets the prefix copied once the
    leader has it (Leaders).
    """

    def __init__(
        self, n_slots: int, n_batch: int, share_prefixes: bool = True, deterministic: bool = False, n_streams: int = 0,
        lone_row_max_cells: int = LONE_ROW_MAX_CELLS, max_outputs: int | None = None, policy: str = "priority",
        checkpoint_every: int | None = None, step_target: float | None = 0.0,
    ) -> None:
        """`max_outputs`: logits rows a step may ask for (scored prompts want one per token, and
        each row is a vocabulary of floats: their chunks shrink to fit). `deterministic`: a
        prompt is prefilled alone, exactly as it would be with no other sequence, decode steps
        hold only decodes, and a decoding sequence never sits alone in a micro-batch once it
        holds many cells (fillers). `checkpoint_every`: memory that cannot be cut (recurrent,
        hybrid) is only reusable where a checkpoint was taken, and one is taken only where a
        decode ends: prompt chunks end every checkpoint_every positions (0: only at the prompt's
        end and where it parts from a cached one); None: memory can be cut anywhere.
        `step_target`: the seconds a step carrying prompt tokens beside decoders keeps to
        (StepBudget; None: a few decode steps' time; 0: no time budget, whole n_batch chunks in
        admission order)."""
        if n_batch < n_slots:
            raise ValueError(f"n_batch ({n_batch}) must be at least the number of slots ({n_slots})")
        self.share_prefixes, self.deterministic, self.policy = share_prefixes, deterministic, policy
        self.n_streams = max(n_streams, n_slots)  # KV streams (seq_ids) the context has
        self.lone_row_max_cells = lone_row_max_cells
        self.checkpoint_every = checkpoint_every
        self.max_outputs = max(max_outputs or n_batch, n_slots)
        self.waiting = WaitingQueue(policy)
        self.running: list[Sequence] = []
        self.slots = SlotPool(n_slots)
        self.leaders = Leaders()
        self.budget = StepBudget(step_target)
        self.composer = Composer(n_batch, self.max_outputs, policy, deterministic, checkpoint_every, self.budget)
        self.n_sampled = 0  # running sequences that draw (not greedy): a greedy step skips looking for them
        self.n_special = 0  # running sequences sampled otherwise than by their sampler alone (Sequence.special)
        # After the KV cache ran full, admitting more would only fill it again: wait until
        # a running sequence finishes and frees its cells.
        self._kv_full = False
        # The last plain step, while it stays the next one: until a sequence joins or leaves,
        # or the stepper says a step did not go as composed (recompose), every running sequence
        # decodes its next token again, in the same rows.
        self._repeat: Step | None = None
        self.version = 0  # counts joins and leaves (queued, admitted, preempted, finished): a snapshot's freshness

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.push(seq)
        self.version += 1

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots. Each comes back with n_past = the tokens its
        slot's cache can give it; the engine checks that and trims the slot's KV to match."""
        admitted = []
        while self.waiting and self.slots.n_free and not (self._kv_full and self.running):
            seq = self.waiting.pop()
            slot, n_cached = self.slots.take(seq, self.share_prefixes and seq.swapped is None)
            # The newest token is decoded again, for its logits; a scored prompt's scored rows too.
            # (A swapped-out sequence gets its own memory back: its n_past stands.)
            seq.admit(slot.seq_id, min(n_cached, len(seq.tokens) - 1, seq.shareable))
            if seq.swapped is None and (self.share_prefixes or self.deterministic):
                self.leaders.follow(seq, whole_only=not self.share_prefixes)
            self.running.append(seq)
            self.n_sampled += seq.draws
            self.n_special += seq.special
            admitted.append(seq)
        if admitted:
            self._repeat = None
            self.version += 1
        return admitted

    def schedule(self, reserved: int = 0, media: int = 0) -> Step:
        """The next step: decoders first (a token each), then prompt chunks filling the n_batch
        budget. `reserved` rows (speculative drafts, which also want logits) are kept out of it;
        `media`: image positions read for this step already (the time budget counts them)."""
        if self._repeat is not None and not reserved:
            return self._repeat
        step, repeats = self.composer.compose(self.running, self.leaders, reserved, self.n_sampled > 0, self.n_special > 0, media)
        self._repeat = step if repeats else None
        return step

    def repeats(self, step: Step) -> bool:
        """Whether schedule() would hand this step over again (no sequence joined or left since)."""
        return self._repeat is step

    def recompose(self) -> None:
        """The last step did not go as composed (a decode failed and memory was put back): the
        next one is composed afresh."""
        self._repeat = None

    def fillers(self, step: Step) -> list[Filler]:
        """Deterministic mode's fillers for the step (fillers.fillers); none otherwise."""
        if not self.deterministic:
            return []
        return fillers(step, self.running, self.slots, self.n_streams, self.lone_row_max_cells)

    def release(self, seq: Sequence) -> None:
        """A sequence finished (or was cancelled while waiting); a running one's slot keeps its KV
        for a later prompt that shares a prefix."""
        self.version += 1
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        else:
            cached = seq.tokens[: seq.n_past] if self.share_prefixes else []  # the engine frees unshared KV
            self.slots.give_back(self._stop_running(seq), cached, seq.adapters)
        seq.leave(Status.FINISHED)
        self._kv_full = False

    def victims(self) -> list[Sequence]:
        """Running sequences to preempt so that waiting ones of a better priority get a slot now:
        past the waiting sequences the free slots will take, each next one (best rank first)
        displaces the worst-ranked running sequence, if that one has a worse priority and, aged,
        still ranks worse. Never among equal priorities (no churn), never under fcfs, nor while
        the KV cache is recovering from running full."""
        if self.policy != "priority" or self._kv_full or not self.running or len(self.waiting) <= self.slots.n_free:
            return []
        if self.waiting.best_priority >= max(seq.priority for seq in self.running):
            return []  # the common case, one priority for all: no sort of the queue
        candidates = sorted(self.running, key=self.rank_of, reverse=True)  # worst first
        chosen = []
        for seq in itertools.islice(self.waiting, self.slots.n_free, None):  # best first
            victim = next((v for v in candidates if v.priority > seq.priority and self.rank_of(v) > self.rank_of(seq)), None)
            if victim is None:
                break
            candidates.remove(victim)
            chosen.append(victim)
        return chosen

    def preempt(self, seq: Sequence, kv_full: bool = True) -> None:
        """Take a running sequence's slot; it waits again at its own rank. Its KV is already freed:
        it re-prefills everything (a scored prompt is scored again), unless the engine swapped
        its KV out (seq.swapped), to be put back when it is admitted again. After a full KV
        cache nothing is admitted until a sequence finishes; a priority preemption admits at once."""
        self.slots.give_back(self._stop_running(seq), cached=[])
        seq.leave(Status.WAITING)
        if seq.swapped is None:
            seq.restart()
        self.waiting.push(seq)
        self.version += 1
        self._kv_full = kv_full

    def rank_of(self, seq: Sequence) -> tuple[float, int]:
        return rank(seq, self.policy)

    def slot_of(self, seq: Sequence) -> Slot:
        """A running sequence's slot; until the sequence ends, its `cached` is what the slot held
        when the sequence was admitted."""
        return self.slots.slot_of(seq.seq_id)

    def _stop_running(self, seq: Sequence) -> int:
        """Take a sequence out of the running set (its prefix ties cut); returns its seq_id."""
        self._repeat = None
        self.running.remove(seq)
        self.n_sampled -= seq.draws
        self.n_special -= seq.special
        self.leaders.retire(seq)
        seq.part()
        return seq.seq_id
