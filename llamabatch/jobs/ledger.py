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
    """Request ids as a sorted array of digests (16 bytes an id, O(log n) membership), each with
    the request digest its recorded line answered (b"" where the line recorded none)."""

    def __init__(self, ids: np.ndarray | None = None, requests: np.ndarray | None = None) -> None:
        if ids is None or not ids.size:
            ids, requests = np.empty(0, dtype="S16"), np.empty(0, dtype="S16")
        order = np.argsort(ids, kind="stable")
        self._ids, self._requests = ids[order], requests[order]

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, str]]) -> IdSet:
        """From (id, request digest) pairs."""
        ids, requests = _columns(((digest(id_), request.encode()) for id_, request in pairs), 2)
        return cls(ids, requests)

    @property
    def ids(self) -> np.ndarray:
        """The id digests, sorted."""
        return self._ids

    def __len__(self) -> int:
        return int(self._ids.size)

    def __contains__(self, id_: str) -> bool:
        return self._find(id_) is not None

    def request(self, id_: str) -> str | None:
        """The request digest recorded with id_'s line ("" if it recorded none); None if id_ is not here."""
        i = self._find(id_)
        return None if i is None else self._requests[i].decode()

    def _find(self, id_: str) -> int | None:
        if not self._ids.size:
            return None
        key = np.array(digest(id_), dtype="S16")
        i = int(np.searchsorted(self._ids, key))
        return i if i < self._ids.size and self._ids[i] == key else None


def find_duplicate(pairs: Callable[[], Iterable[tuple[str, int]]]) -> tuple[np.ndarray, tuple[str, int, int] | None]:
    """The sorted digests of the ids that `pairs()` yields (with their lines), and an id given
    twice, as (id, first line, second line). One pass keeps only digests; a second runs only if
    one repeats."""
    [ordered] = _columns(((digest(id_),) for id_, _ in pairs()), 1)
    ordered = np.sort(ordered)
    repeats = np.flatnonzero(ordered[1:] == ordered[:-1])
    if not repeats.size:
        return ordered, None
    twice = ordered[repeats[0]]
    (id_, first), (_, second) = itertools.islice(
        ((id_, n) for id_, n in pairs() if np.array(digest(id_), dtype="S16") == twice), 2
    )
    return ordered, (id_, first, second)


def _columns(rows: Iterable[tuple[bytes, ...]], width: int, chunk: int = 65536) -> list[np.ndarray]:
    """The rows' 16-byte values as `width` columns, built in chunks: no list of millions of bytes
    objects is ever held."""
    rows, parts = iter(rows), [[] for _ in range(width)]  # one iterator, sliced chunk by chunk
    for block in iter(lambda: list(itertools.islice(rows, chunk)), []):
        for k in range(width):
            parts[k].append(np.array([row[k] for row in block], dtype="S16"))
    return [np.concatenate(p) if p else np.empty(0, dtype="S16") for p in parts]


class JsonlLog:
    """An append-only JSON Lines file of a job's results (or failures)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = None
        self._synced_at = 0.0

    def recorded(self, key: str) -> Iterator[tuple[str, str]]:
        """The `key` field (the request's id) of every line already in the file, with the request
        digest the line recorded ("" for none). A torn last line (no newline, or
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
                    request = record.get("request_digest")
                    yield record[key], request if isinstance(request, str) else ""
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
