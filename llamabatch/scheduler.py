"""Which sequences go into the next batch, and how many tokens each brings."""

from __future__ import annotations

import heapq
import time
from collections import deque

from .sequence import Sequence, Status


class Scheduler:
    """Owns the waiting queue and the running set; hands out seq_ids (slots).

    Each step every running sequence that is generating brings its one new token,
    so generation never stalls behind a long prompt; prompt prefill fills the rest
    of the n_batch token budget, in admission order, in chunks.
    """

    def __init__(self, n_slots: int, n_batch: int) -> None:
        if n_batch < n_slots:
            raise ValueError(f"n_batch ({n_batch}) must be at least the number of slots ({n_slots})")
        self.n_batch = n_batch
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_ids = list(range(n_slots))  # a heap: lowest free seq_id first
        # After the KV cache ran full, admitting more would only fill it again: wait until
        # a running sequence finishes and frees its cells.
        self._kv_full = False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[Sequence]:
        """The sequences for the next batch, each with n_chunk set; decoders first, then prefill."""
        self._admit()
        generating = [s for s in self.running if not s.is_prefilling]
        prefilling = [s for s in self.running if s.is_prefilling]
        budget = self.n_batch - len(generating)
        for seq in generating:
            seq.n_chunk = 1
        scheduled = list(generating)
        for seq in prefilling:
            if budget == 0:
                break
            seq.n_chunk = min(seq.n_pending, budget)
            budget -= seq.n_chunk
            scheduled.append(seq)
        return scheduled

    def release(self, seq: Sequence) -> None:
        """A running sequence finished: give its slot back."""
        self._give_back_slot(seq)
        seq.status = Status.FINISHED
        self._kv_full = False

    def preempt(self, seq: Sequence) -> None:
        """Take a running sequence's slot back; it re-enters first and re-prefills all its tokens."""
        self._give_back_slot(seq)
        seq.n_past, seq.status = 0, Status.WAITING
        self.waiting.appendleft(seq)
        self._kv_full = True

    def _give_back_slot(self, seq: Sequence) -> None:
        self.running.remove(seq)
        heapq.heappush(self._free_ids, seq.seq_id)
        seq.seq_id = -1

    def _admit(self) -> None:
        while self.waiting and self._free_ids and not (self._kv_full and self.running):
            seq = self.waiting.popleft()
            seq.seq_id = heapq.heappop(self._free_ids)
            seq.status = Status.RUNNING
            seq.t_admitted = time.perf_counter()
            self.running.append(seq)
