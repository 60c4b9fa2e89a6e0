"""Which sequences go into the next batch, how many tokens each brings, and which KV they reuse."""

from __future__ import annotations

import heapq
import itertools
import operator
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from .adapters import BASE, AdapterSet
from .prefix_index import PrefixIndex
from .sequence import Sequence, Status
from .step import Step

# Shorter shared prefixes are decoded again: waiting for a leader and pausing its prefill at
# the shared length, or giving up another slot's cache, costs more than a few tokens of prefill.
MIN_SHARED_PREFIX = 8

# ggml-cpu's flash attention takes a split-KV path (different summation order) for a micro-batch
# of one query row in one KV stream once the stream's view (padded to 256 cells) reaches 512
# cells, i.e. once a sequence holds more than 256. In deterministic mode such a row gets a filler.
# (With float weights every lone row does: llamafile's sgemm serves only 2 rows or more.)
LONE_ROW_MAX_CELLS = 256

# Priorities (lower runs first, as vLLM's `priority`) age: a sequence gains one level for every
# AGING_S seconds it waits, so a stream of higher-priority work delays lower work but never
# starves it. Ranked as priority * AGING_S + submission time, an order that waiting cannot change.
AGING_S = 5.0
# The batch class (server-side batches) ranks this many levels below interactive requests: it
# yields to interactive work that arrives up to BATCH_PRIORITY * AGING_S (10 minutes) after it.
BATCH_PRIORITY = 120


def rank(seq: Sequence, policy: str = "priority") -> tuple[float, int]:
    """Admission order: smaller first. fcfs ignores priorities: submission order alone."""
    levels = seq.priority * AGING_S if policy == "priority" else 0.0
    return levels + seq.t_submitted, seq.uid


class WaitingQueue:
    """Sequences waiting for a slot, best rank first (a heap: a queue of thousands stays cheap)."""

    def __init__(self, policy: str = "priority") -> None:
        self.policy = policy
        self._heap: list[tuple[tuple[float, int], int, Sequence]] = []
        self._pushed = itertools.count()  # ties (equal uid: hand-made sequences) keep push order
        self._levels: Counter[int] = Counter()  # how many wait at each priority
        self._classes: Counter[str] = Counter()  # and in each class

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (rank(seq, self.policy), next(self._pushed), seq))
        self._levels[seq.priority] += 1
        self._classes[seq.priority_class] += 1

    def pop(self) -> Sequence:
        seq = heapq.heappop(self._heap)[2]
        self._forget(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        self._heap = [entry for entry in self._heap if entry[2] is not seq]
        heapq.heapify(self._heap)
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        self._classes[seq.priority_class] -= 1
        self._levels[seq.priority] -= 1
        if not self._levels[seq.priority]:
            del self._levels[seq.priority]

    def count(self, priority_class: str) -> int:
        return self._classes[priority_class]

    @property
    def best_priority(self) -> int:
        """The best (lowest) priority waiting, unaged."""
        return min(self._levels)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        """In admission order."""
        return (entry[2] for entry in sorted(self._heap, key=lambda entry: entry[:2]))


@dataclass(frozen=True)
class Filler:
    """A throwaway token decoded in another KV stream beside a sequence that would otherwise be
    alone in its micro-batch; its cell is removed right after the decode."""

    seq_id: int
    pos: int


@dataclass(eq=False)
class Slot:
    """One seq_id. A free slot keeps the KV of its last sequence, for a later prompt that starts alike."""

    seq_id: int
    cached: list[int] = field(default_factory=list)  # tokens at positions 0.. whose KV it holds
    adapters: AdapterSet = BASE  # the LoRA adapters that KV was computed under


class Scheduler:
    """Owns the waiting queue, the running set and the slots.

    Waiting sequences are admitted best rank first (priority, aged by waiting time; see rank).
    When one waits with no slot free, running sequences of a worse rank make way for it
    (victims(): the engine keeps or frees their KV, then preempt()).

    Each step every running sequence that is generating brings its one new token,
    so generation never stalls behind a long prompt; prompt prefill fills the rest
    of the n_batch token budget, in admission order, in chunks.

    Prompt KV is shared two ways. A new sequence takes the free slot whose cached
    tokens share the longest prefix with it, keeping that prefix (else the lowest free
    seq_id, whose cache is overwritten). And a sequence admitted while another is still prefilling the same
    prefix follows it: it waits, and gets the prefix copied once the leader has it.
    """

    def __init__(
        self, n_slots: int, n_batch: int, share_prefixes: bool = True, batch_invariant: bool = False, n_streams: int = 0,
        lone_row_max_cells: int = LONE_ROW_MAX_CELLS, max_outputs: int | None = None, policy: str = "priority",
        checkpoint_every: int | None = None,
    ) -> None:
        if n_batch < n_slots:
            raise ValueError(f"n_batch ({n_batch}) must be at least the number of slots ({n_slots})")
        self.n_batch = n_batch
        # Logits rows a step may ask for: scored prompts want one per token, and each row is a
        # vocabulary of floats (1 MiB for Gemma 3), so their chunks shrink to fit.
        self.max_outputs = max(max_outputs or n_batch, n_slots)
        self.share_prefixes = share_prefixes
        # Deterministic mode: a prompt is prefilled alone, exactly as it would be with no other
        # sequence, and decode steps hold only decodes. A decoding sequence never sits alone in
        # a micro-batch once it holds many cells (fillers).
        self.batch_invariant = batch_invariant
        self.n_streams = max(n_streams, n_slots)  # KV streams (seq_ids) the context has
        self.lone_row_max_cells = lone_row_max_cells
        self._prefilled_since_decode = 0  # prompt tokens; deterministic mode
        # Memory that cannot be cut (recurrent, hybrid) is only reusable where a checkpoint was
        # taken, and a checkpoint only where a decode ends: prompt chunks end every
        # checkpoint_every positions (0: only at the prompt's end and at a parting point); None:
        # the memory can be cut anywhere, no checkpoints.
        self.checkpoint_every = checkpoint_every
        self.policy = policy
        self.waiting = WaitingQueue(policy)
        self.running: list[Sequence] = []
        self.n_sampled = 0  # running sequences that draw (not greedy): a greedy step skips looking for them
        self.n_special = 0  # running sequences sampled otherwise than by their sampler alone (Sequence.special)
        self._free: dict[int, Slot] = {i: Slot(i) for i in range(n_slots)}  # seq_id -> free slot
        self._free_ids = list(range(n_slots))  # a heap of free seq_ids (and some taken since: skipped)
        self._slots: dict[int, Slot] = {}  # seq_id -> slot of each running sequence
        # Who holds which prefix, looked up without a scan: free slots' cached KV, and running
        # sequences that have not sampled yet (once decoding, they hold their whole prompt and lead no one).
        # Both are keyed by adapter set too: KV computed under other adapters is another KV.
        self._cached: PrefixIndex[Slot] = PrefixIndex(lambda slot: slot.cached, lambda slot: slot.adapters)
        self._leaders: PrefixIndex[Sequence] = PrefixIndex(lambda seq: seq.tokens, lambda seq: seq.adapters)
        # LoRA adapter sets take turns (llama.cpp decodes one set per step): the step each last had.
        self._turn = 0
        self._last_turn: dict[AdapterSet, int] = {}
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
        while self.waiting and self._free and not (self._kv_full and self.running):
            seq = self.waiting.pop()
            slot, n_cached = self._take_slot(seq)
            # The newest token is decoded again, for its logits; a scored prompt's scored rows too.
            # (A swapped-out sequence gets its own memory back: its n_past stands.)
            seq.admit(slot.seq_id, min(n_cached, len(seq.tokens) - 1, seq.shareable))
            if seq.swapped is None and (self.share_prefixes or self.batch_invariant):
                self._follow_a_leader(seq)
            self.running.append(seq)
            self.n_sampled += seq.draws
            self.n_special += seq.special
            admitted.append(seq)
        if admitted:
            self._repeat = None
            self.version += 1
        return admitted

    def recompose(self) -> None:
        """The last step did not go as composed (a decode failed and memory was put back): the
        next one is composed afresh."""
        self._repeat = None

    def schedule(self, reserved: int = 0) -> Step:
        """The next step: decoders first (a token each), then prompt chunks filling the n_batch
        budget. `reserved` rows (speculative drafts, which also want logits) are kept out of it."""
        if self._repeat is not None and not reserved:
            return self._repeat
        step, repeats = self._compose(reserved)
        self._repeat = step if repeats else None
        return step

    def _compose(self, reserved: int) -> tuple[Step, bool]:
        """The step, and whether it repeats as it is until a sequence joins or leaves (plain, and
        not one adapter set's turn among several)."""
        generating, prefilling = [], []
        plain = not reserved  # so far every row decodes a sampled token
        first = self.running[0].adapters if self.running else BASE
        mixed = False  # sequences under different adapter sets
        for seq in self.running:  # one pass, no properties: this runs every step
            if seq.adapters is not first and seq.adapters != first:
                mixed = True
            if len(seq.tokens) - seq.n_past > 1:
                if seq.leader is None:
                    prefilling.append(seq)
            elif seq.leader is None:
                generating.append(seq)
                if seq.n_past <= seq.n_prompt:  # its prompt is in, or its last token goes in now
                    if seq in self._leaders:  # it can no longer lead
                        self._leaders.remove(seq)
                    if seq.n_past < seq.n_prompt:  # that last token's row may score it, or hand on a prefix
                        plain = False
        if mixed:
            generating, prefilling = self._one_adapter_set(generating, prefilling)
        if self.batch_invariant:
            return self._isolated(generating, prefilling), False
        if prefilling and self.policy == "priority":
            generating, prefilling = _held_back(generating, prefilling)
        budget, outputs = self.n_batch - len(generating) - reserved, len(generating) + reserved
        chunks = dict.fromkeys(generating, 1)
        checkpoints = set()
        for seq in prefilling:
            if budget == 0:
                break
            cap = seq.prefix_cap
            n = self._fit_outputs(seq, min(seq.n_pending, budget, cap - seq.n_past if cap else budget), outputs)
            if n == 0:
                continue
            chunks[seq], checkpoint = self._stop_at_checkpoint(seq, n)
            if checkpoint:
                checkpoints.add(seq.uid)
            budget -= n
            outputs += len(seq.scored_rows(seq.n_past, n)) + 1
        plain = plain and len(chunks) == len(generating)
        return self._step(chunks, plain, frozenset(checkpoints)), plain and not mixed

    def _step(self, chunks: dict[Sequence, int], plain: bool, checkpoints: frozenset[int] = frozenset()) -> Step:
        rows = sorted(chunks, key=_by_seq_id)  # rows in seq_id order: see _take_slot
        return Step(rows, [chunks[seq] for seq in rows], plain, self.n_sampled > 0, self.n_special > 0, checkpoints)

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

    def _isolated(self, generating: list[Sequence], prefilling: list[Sequence]) -> Step:
        """One prompt's prefill alone, in the chunks a solo run uses; or every decode. As in a
        mixed step, decoders wait for at most n_batch prompt tokens between their steps."""
        if prefilling and (not generating or self._prefilled_since_decode < self.n_batch):
            seq = prefilling[0]
            n, checkpoint = self._stop_at_checkpoint(seq, max(1, self._fit_outputs(seq, min(seq.n_pending, self.n_batch), 0)))
            self._prefilled_since_decode += n
            return self._step({seq: n}, False, frozenset([seq.uid]) if checkpoint else frozenset())
        self._prefilled_since_decode = 0
        return self._step(dict.fromkeys(generating, 1), False)

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

    def fillers(self, step: Step) -> list[Filler]:
        """Deterministic mode: a filler beside each one-token row whose sequence holds more than
        lone_row_max_cells cells with it and has no neighbouring seq_id in the batch. llama.cpp groups
        only consecutive seq_ids into one micro-batch, so the filler takes a neighbouring id
        that is not decoding, at that stream's next position."""
        if not self.batch_invariant:
            return []
        taken = {seq.seq_id for seq in step.rows}
        fillers = []
        for seq, n in zip(step.rows, step.chunks):
            k = seq.seq_id
            if n != 1 or seq.n_past < self.lone_row_max_cells or k - 1 in taken or k + 1 in taken:
                continue
            j = k + 1 if k + 1 < self.n_streams else k - 1
            taken.add(j)
            fillers.append(Filler(j, self._next_position(j)))
        return fillers

    def _next_position(self, seq_id: int) -> int:
        """Where a stream's next token goes: after its running sequence's or free slot's KV."""
        for seq in self.running:
            if seq.seq_id == seq_id:
                return seq.n_past
        slot = self._free.get(seq_id)
        return len(slot.cached) if slot is not None else 0  # a stream beyond the slots is always empty

    def release(self, seq: Sequence) -> None:
        """A sequence finished (or was cancelled while waiting); a running one's slot keeps its KV
        for a later prompt that shares a prefix."""
        self.version += 1
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        else:
            cached = seq.tokens[: seq.n_past] if self.share_prefixes else []  # the engine frees unshared KV
            self._free_slot(self._give_back_slot(seq), cached, seq.adapters)
        seq.leave(Status.FINISHED)
        self._kv_full = False

    def victims(self) -> list[Sequence]:
        """Running sequences to preempt so that waiting ones of a better priority get a slot now:
        past the waiting sequences the free slots will take, each next one (best rank first)
        displaces the worst-ranked running sequence, if that one has a worse priority and, aged,
        still ranks worse. Never among equal priorities (no churn), never under fcfs, nor while
        the KV cache is recovering from running full."""
        if self.policy != "priority" or self._kv_full or not self.running or len(self.waiting) <= len(self._free):
            return []
        if self.waiting.best_priority >= max(seq.priority for seq in self.running):
            return []  # the common case, one priority for all: no sort of the queue
        candidates = sorted(self.running, key=self.rank_of, reverse=True)  # worst first
        chosen = []
        for seq in itertools.islice(self.waiting, len(self._free), None):  # best first
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
        self._free_slot(self._give_back_slot(seq), cached=[])
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
        return self._slots[seq.seq_id]

    def cached_slots(self) -> list[Slot]:
        """The free slots that hold a prefix for later prompts."""
        return [slot for slot in self._free.values() if slot.cached]

    @property
    def has_cached_prefixes(self) -> bool:
        return len(self._cached) > 0

    def evict_cached(self) -> list[int]:
        """Forget every free slot's cached KV (the KV cache is full); returns their seq_ids to clear."""
        evicted = [slot.seq_id for slot in self._free.values() if slot.cached]
        for slot in self._free.values():
            slot.cached = []
        self._cached.clear()
        return evicted

    def _take_slot(self, seq: Sequence) -> tuple[Slot, int]:
        """The free slot whose cache shares the longest prefix with seq, and that prefix's length;
        without one worth keeping, the lowest seq_id. With a per-sequence KV cache llama.cpp puts
        only consecutive seq_ids in one ubatch, so dense low ids keep a step to one graph."""
        best, n_best = None, 0
        if self.share_prefixes and seq.swapped is None:
            n, slot = next(self._cached.matches(seq.tokens, seq.adapters), (0, None))
            if n >= _worth_sharing(seq):
                best, n_best = slot, n
        if best is None:
            while self._free_ids[0] not in self._free:  # taken by a prefix match since it was freed
                heapq.heappop(self._free_ids)
            best = self._free[heapq.heappop(self._free_ids)]
        del self._free[best.seq_id]
        self._cached.remove(best)
        self._slots[best.seq_id] = best
        return best, n_best

    def _free_slot(self, slot: Slot, cached: list[int], adapters: AdapterSet = BASE) -> None:
        slot.cached, slot.adapters = cached, adapters
        self._free[slot.seq_id] = slot
        heapq.heappush(self._free_ids, slot.seq_id)
        if len(self._free_ids) > 2 * (len(self._free) + len(self._slots)):  # stale ids: start again
            self._free_ids = sorted(self._free)
        if cached:
            self._cached.add(slot)

    def _give_back_slot(self, seq: Sequence) -> Slot:
        self._repeat = None
        self.running.remove(seq)
        self.n_sampled -= seq.draws
        self.n_special -= seq.special
        self._leaders.remove(seq)
        if seq.leader is not None:  # it never got its prefix
            seq.leader.followers.remove(seq)
            seq.leader = None
        for follower in seq.followers:  # they prefill on their own now
            follower.leader = None
        seq.followers = []
        return self._slots.pop(seq.seq_id)

    def _follow_a_leader(self, seq: Sequence) -> None:
        """Follow the running sequence still prefilling the longest prefix this one shares, then
        become a possible leader for later ones. Without prefix sharing (deterministic mode) only
        an identical prompt is followed, as -n samples are: the follower samples from the row
        the leader's prefill computed, and its copied KV is that prefill's, so its arithmetic is
        a solo run's; a partial copy would change how the rest of its prompt is computed."""
        n_best = max(seq.n_past, 0)
        whole_only = not self.share_prefixes
        for n, other in self._leaders.matches(seq.tokens, seq.adapters):
            if whole_only and not n == len(seq.tokens) == len(other.tokens):
                continue
            if n == len(seq.tokens) and len(other.tokens) > n:
                n -= 1  # it must sample from the leader's logits, which exist only at its newest token
            n = min(n, seq.shareable)
            if n > n_best and n > other.n_past and n >= _worth_sharing(seq):
                seq.leader, seq.n_shared = other, n
                other.followers.append(seq)
                break
        if seq.n_generated == 0:  # until it samples, a prompt others can wait for
            self._leaders.add(seq)


_by_seq_id = operator.attrgetter("seq_id")


def _held_back(generating: list[Sequence], prefilling: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """The decoders and prompts that join a step prefilling the best priority's prompt: none of a
    worse priority. On a CPU each row lengthens the step, and the step is what a waiting
    request's first token waits for (Gemma 3 270M on 2 cores: 18 ms a step alone, 64 ms beside
    7 decoding batch sequences); they skip a step per such prompt chunk."""
    best = min(seq.priority for seq in prefilling)
    return [seq for seq in generating if seq.priority <= best], [seq for seq in prefilling if seq.priority <= best]


def _worth_sharing(seq: Sequence) -> int:
    """The shortest common prefix worth reusing for seq: MIN_SHARED_PREFIX, or all of a shorter prompt."""
    return min(MIN_SHARED_PREFIX, len(seq.tokens))
