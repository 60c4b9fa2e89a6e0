"""The waiting queue: sequences without a slot, best rank first, a rank that ages."""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterator

from ..sequence import Sequence

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
