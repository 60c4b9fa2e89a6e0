"""What a job has written, and what it may skip: append-only JSON Lines files whose lines are
flushed as they are written, a torn last line (a killed writer) cut off when resuming, and
sets of request ids kept as 16-byte digests so a job of millions of lines stays small."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from ..errors import LlamabatchError

# Lines are flushed to the OS as written (a killed process loses none); fsync, which a power
# loss needs, at most this often and at close: once per line would cost more than a tiny
# model's decode step.
FSYNC_INTERVAL_S = 1.0


def digest(id_: str) -> bytes:
    """16 bytes of BLAKE2b: 128 bits, so ids of different requests never share one in practice."""
    return hashlib.blake2b(id_.encode(), digest_size=16).digest()


class IdSet:
    """Request ids as a sorted array of digests: 16 bytes an id, O(log n) membership."""

    def __init__(self, digests: np.ndarray | None = None) -> None:
        self._sorted = np.unique(digests) if digests is not None and digests.size else np.empty(0, dtype="S16")

    @classmethod
    def of(cls, ids: Iterable[str]) -> IdSet:
        return cls(_digest_array(ids))

    def __len__(self) -> int:
        return int(self._sorted.size)

    def __contains__(self, id_: str) -> bool:
        if not self._sorted.size:
            return False
        key = np.array(digest(id_), dtype="S16")
        i = int(np.searchsorted(self._sorted, key))
        return i < self._sorted.size and self._sorted[i] == key


def find_duplicate(pairs: Callable[[], Iterable[tuple[str, int]]]) -> tuple[int, tuple[str, int, int] | None]:
    """Count the (id, line) pairs that `pairs()` yields and find an id given twice, as (id, first
    line, second line). One pass keeps only digests; a second runs only if one repeats."""
    ordered = np.sort(_digest_array(id_ for id_, _ in pairs()))
    repeats = np.flatnonzero(ordered[1:] == ordered[:-1])
    if not repeats.size:
        return int(ordered.size), None
    twice = ordered[repeats[0]]
    (id_, first), (_, second) = itertools.islice(
        ((id_, n) for id_, n in pairs() if np.array(digest(id_), dtype="S16") == twice), 2
    )
    return int(ordered.size), (id_, first, second)


def _digest_array(ids: Iterable[str], chunk: int = 65536) -> np.ndarray:
    """Digests of ids in chunks, so no list of millions of bytes objects is ever held."""
    parts, buf = [], []
    for id_ in ids:
        buf.append(digest(id_))
        if len(buf) == chunk:
            parts.append(np.array(buf, dtype="S16"))
            buf = []
    parts.append(np.array(buf, dtype="S16"))
    return np.concatenate(parts)


class JsonlLog:
    """An append-only JSON Lines file of a job's results (or failures)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = None
        self._synced_at = 0.0

    def recorded(self, key: str) -> Iterator[str]:
        """The `key` field of every line already in the file. A torn last line (no newline, or
        not JSON: the writer was killed mid-line) is cut off; a bad line elsewhere is an error,
        since the file would not be this job's output."""
        if not self.path.exists():
            return
        good_end = 0
        with self.path.open("rb") as f:
            for n, raw in enumerate(f, 1):
                record = _record(raw)
                if record is None or not raw.endswith(b"\n"):
                    if f.read(1):  # something follows: not a torn tail
                        raise LlamabatchError(
                            f"{self.path}:{n} is not a JSON line written by llamabatch batch: "
                            "use --overwrite or another output file"
                        )
                    break
                good_end += len(raw)
                if isinstance(record.get(key), str):
                    yield record[key]
        if good_end < self.path.stat().st_size:
            os.truncate(self.path, good_end)

    def open(self, fresh: bool) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w" if fresh else "a", encoding="utf-8")

    def write(self, obj: dict) -> None:
        self._file.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self._file.flush()
        now = time.monotonic()
        if now - self._synced_at >= FSYNC_INTERVAL_S:
            os.fsync(self._file.fileno())
            self._synced_at = now

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def _record(raw: bytes) -> dict | None:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None
