"""The slots (seq_ids) and what the free ones keep: the KV of their last sequence, for a later
prompt that starts alike."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from ..adapters import BASE, AdapterSet
from ..sequence import Sequence
from .prefix_index import PrefixIndex, worth_sharing


@dataclass(eq=False)
class Slot:
    """One seq_id. A free slot keeps the KV of its last sequence, for a later prompt that starts alike."""

    seq_id: int
    cached: list[int] = field(default_factory=list)  # tokens at positions 0.. whose KV it holds
    adapters: AdapterSet = BASE  # the LoRA adapters that KV was computed under


class SlotPool:
    """Free and taken slots. A free slot's cached prefix is found without a scan (keyed by its
    adapter set too: KV computed under other adapters is another KV); without one worth
    keeping, the lowest free seq_id is taken: with a per-sequence KV cache llama.cpp puts only
    consecutive seq_ids in one ubatch, so dense low ids keep a step to one graph."""

    def __init__(self, n_slots: int) -> None:
        self._free: dict[int, Slot] = {i: Slot(i) for i in range(n_slots)}  # seq_id -> free slot
        self._free_ids = list(range(n_slots))  # a heap of free seq_ids (and some taken since: skipped)
        self._taken: dict[int, Slot] = {}  # seq_id -> slot of each running sequence
        self._cached: PrefixIndex[Slot] = PrefixIndex(lambda slot: slot.cached, lambda slot: slot.adapters)

    @property
    def n_free(self) -> int:
        return len(self._free)

    def take(self, seq: Sequence, share: bool) -> tuple[Slot, int]:
        """The free slot whose cache shares the longest prefix with seq (when `share`), and that
        prefix's length; else the lowest free seq_id, and 0."""
        best, n_best = None, 0
        if share:
            n, slot = next(self._cached.matches(seq.tokens, seq.adapters), (0, None))
            if n >= worth_sharing(seq):
                best, n_best = slot, n
        if best is None:
            while self._free_ids[0] not in self._free:  # taken by a prefix match since it was freed
                heapq.heappop(self._free_ids)
            best = self._free[heapq.heappop(self._free_ids)]
        del self._free[best.seq_id]
        self._cached.remove(best)
        self._taken[best.seq_id] = best
        return best, n_best

    def give_back(self, seq_id: int, cached: list[int], adapters: AdapterSet = BASE) -> None:
        """A taken slot is free again, keeping the KV of `cached` (under `adapters`)."""
        slot = self._taken.pop(seq_id)
        slot.cached, slot.adapters = cached, adapters
        self._free[seq_id] = slot
        heapq.heappush(self._free_ids, seq_id)
        if len(self._free_ids) > 2 * (len(self._free) + len(self._taken)):  # stale ids: start again
            self._free_ids = sorted(self._free)
        if cached:
            self._cached.add(slot)

    def slot_of(self, seq_id: int) -> Slot:
        """A taken slot; until its sequence ends, `cached` is what it held when it was taken."""
        return self._taken[seq_id]

    def free_slot(self, seq_id: int) -> Slot | None:
        return self._free.get(seq_id)

    def cached_slots(self) -> list[Slot]:
        """The free slots that hold a prefix for later prompts."""
        return [slot for slot in self._free.values() if slot.cached]

    @property
    def has_cached(self) -> bool:
        return len(self._cached) > 0

    def evict_cached(self) -> list[int]:
        """Forget every free slot's cached KV; returns their seq_ids, for the memory to clear."""
        evicted = [slot.seq_id for slot in self._free.values() if slot.cached]
        for slot in self._free.values():
            slot.cached = []
        self._cached.clear()
        return evicted
