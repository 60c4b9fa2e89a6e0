"""The server's files, batches and stored responses, durable under --data-dir: their contents as files on disk,
their metadata in SQLite (WAL mode, each change committed before it is answered), so a server
killed at any moment starts again knowing every file and every batch's state.

One server owns a data directory at a time (an exclusive lock on DATA_DIR/lock): two would both
resume the same batches.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import LlamabatchError

log = logging.getLogger("llamabatch.serve")

# A batch may still be running (or resumed) in these states; the others are final.
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
_UNFINISHED_SQL = f"status IN ({', '.join(repr(status) for status in UNFINISHED)})"
COMPLETION_WINDOW_S = 24 * 3600  # "24h", the only window OpenAI offers

# The store's layout, in the database's user_version. MIGRATIONS[n] brings a store of version n to
# n + 1; a store written before versions were kept reads as 0, and the first migration (CREATE ... IF
# NOT EXISTS) makes an empty folder's tables or accepts theirs, which are the same. A change to the
# layout appends a migration; a store newer than this code is refused rather than misread.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, path TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL, completion_window TEXT NOT NULL,
    status TEXT NOT NULL, metadata TEXT, errors TEXT, output_file_id TEXT, error_file_id TEXT,
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER,
    completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, body TEXT NOT NULL, conversation TEXT NOT NULL
);
"""
MIGRATIONS = (_SCHEMA,)
SCHEMA_VERSION = len(MIGRATIONS)
_FILE_FIELDS = ("id", "filename", "purpose", "bytes", "created_at", "path")
_TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")


class NotFound(LlamabatchError):
    """No file, batch or response has that id."""


ROW_NOUN = {"files": "file", "batches": "batch", "responses": "response"}  # what a row of each table is called in messages


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/llamabatch, else ~/.local/share/llamabatch."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "llamabatch"


@dataclass(frozen=True)
class StoredFile:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    path: Path

    def to_openai(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


class Store:
    """Files and batches in DATA_DIR: uploads in files/, each batch's output and error lines in
    batches/ID/, metadata in llamabatch.sqlite3. Safe to call from any thread; the engine thread hands its
    writes to the store's own writer thread (later()), so it never waits for a commit's fsync."""

    def __init__(self, data_dir: str | Path) -> None:
        self.root = Path(data_dir)
        (self.root / "files").mkdir(parents=True, exist_ok=True)
        (self.root / "batches").mkdir(exist_ok=True)
        self._lock_file = (self.root / "lock").open("a")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise LlamabatchError(f"another llamabatch serve is using the data directory {self.root} (--data-dir)") from None
        self._db = sqlite3.connect(self.root / "llamabatch.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a commit survives a power cut, not only a kill
        self._migrate()
        self._mutex = threading.Lock()
        self._writes: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_in_order, name="llamabatch-store", daemon=True)
        self._writer.start()

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            self._db.close()
            self._lock_file.close()
            raise LlamabatchError(f"the data directory {self.root} was written by a newer llamabatch (store version {version}, "
                                  f"this one reads up to {SCHEMA_VERSION}): upgrade, or use another --data-dir")
        for step in range(version, SCHEMA_VERSION):
            # One transaction a step (executescript commits what is pending first): a crash
            # mid-migration leaves the store at the last version it fully reached.
            self._db.executescript(f"BEGIN; {MIGRATIONS[step]} PRAGMA user_version = {step + 1}; COMMIT;")

    def later(self, write: Callable[[], object]) -> None:
        """Run `write` (a call of this store's) on the writer thread, after those handed in before."""
        self._writes.put(write)

    def _write_in_order(self) -> None:
        while (write := self._writes.get()) is not None:
            try:
                write()
            except Exception:  # noqa: BLE001 - nobody waits for it: logged, and the next write goes on
                log.exception("a write to the store in %s failed", self.root)

    def close(self) -> None:
        """Once every write handed in is done: close the database and release the directory."""
        self._writes.put(None)
        self._writer.join()
        self._db.close()
        self._lock_file.close()  # releases the lock

    @contextmanager
    def _sql(self) -> Iterator[sqlite3.Connection]:
        with self._mutex:
            yield self._db

    # -- responses (OpenAI's Responses API, for previous_response_id) -------------------------

    def add_response(self, body: dict, conversation: list[dict]) -> None:
        """A response object, and its whole conversation as chat messages (what a later
        request naming it as previous_response_id continues)."""
        with self._sql() as db:
            db.execute("INSERT INTO responses VALUES (?, ?, ?, ?)",
                       (body["id"], int(body["created_at"]), json.dumps(body), json.dumps(conversation)))

    def response(self, response_id: str) -> tuple[dict, list[dict]]:
        with self._sql() as db:
            row = db.execute("SELECT body, conversation FROM responses WHERE id = ?", (response_id,)).fetchone()
        if row is None:
            raise NotFound(f"no response with id {response_id!r}")
        return json.loads(row["body"]), json.loads(row["conversation"])

    def delete_response(self, response_id: str) -> None:
        with self._sql() as db:
            if db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount == 0:
                raise NotFound(f"no response with id {response_id!r}")

    # -- files -----------------------------------------------------------------------------

    def new_file_path(self) -> tuple[str, Path]:
        """An id for an upload, and where its bytes go."""
        file_id = f"file-{secrets.token_hex(12)}"
        return file_id, self.root / "files" / f"{file_id}.jsonl"

    def add_file(self, file_id: str, filename: str, purpose: str, path: Path) -> StoredFile:
        stored = StoredFile(file_id, filename, purpose, path.stat().st_size, int(time.time()), path)
        with self._sql() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)", (*_row(stored),))
        return stored

    def file(self, file_id: str) -> StoredFile:
        with self._sql() as db:
            row = db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise NotFound(f"no file with id {file_id!r}")
        return _file(row)

    def files(self, purpose: str | None, limit: int, after: str | None, ascending: bool) -> tuple[list[StoredFile], bool]:
        where, args = ("purpose = ?", [purpose]) if purpose else ("1", [])
        rows, more = self._page("files", where, args, limit, after, ascending)
        return [_file(r) for r in rows], more

    def delete_file(self, file_id: str) -> None:
        """Refused while an unfinished batch reads it (a restarted server would find it gone)."""
        stored = self.file(file_id)
        with self._sql() as db:
            user = db.execute(f"SELECT id FROM batches WHERE input_file_id = ? AND {_UNFINISHED_SQL}", (file_id,)).fetchone()
            if user is not None:
                raise LlamabatchError(f"file {file_id} is the input of batch {user['id']}, which has not finished: cancel it first")
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        if stored.path.parent == self.root / "files":  # a batch's output stays in its folder until the batch goes
            stored.path.unlink(missing_ok=True)

    # -- batches ---------------------------------------------------------------------------

    def batch_dir(self, batch_id: str) -> Path:
        return self.root / "batches" / batch_id

    def add_batch(self, input_file_id: str, endpoint: str, metadata: dict | None) -> dict:
        batch_id = f"batch_{secrets.token_hex(12)}"
        now = int(time.time())
        with self._sql() as db:
            db.execute(
                "INSERT INTO batches (id, input_file_id, endpoint, completion_window, status, metadata, created_at, expires_at)"
                " VALUES (?, ?, ?, '24h', 'validating', ?, ?, ?)",
                (batch_id, input_file_id, endpoint, json.dumps(metadata) if metadata is not None else None, now,
                 now + COMPLETION_WINDOW_S),
            )
        return self.batch(batch_id)

    def batch(self, batch_id: str) -> dict:
        with self._sql() as db:
            row = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise NotFound(f"no batch with id {batch_id!r}")
        return dict(row)

    def batches(self, limit: int, after: str | None) -> tuple[list[dict], bool]:
        rows, more = self._page("batches", "1", [], limit, after, ascending=False)
        return [dict(r) for r in rows], more

    def unfinished_batches(self) -> list[dict]:
        with self._sql() as db:
            rows = db.execute(f"SELECT * FROM batches WHERE {_UNFINISHED_SQL} ORDER BY rowid").fetchall()
        return [dict(r) for r in rows]

    def update_batch(self, batch_id: str, **fields) -> None:
        """Set fields; a new status also stamps its *_at time (unless given)."""
        status = fields.get("status")
        if status is not None and f"{status}_at" in _TIMESTAMPS:
            fields.setdefault(f"{status}_at", int(time.time()))
        if "errors" in fields and fields["errors"] is not None:
            fields["errors"] = json.dumps(fields["errors"])
        assignments = ", ".join(f"{name} = ?" for name in fields)
        with self._sql() as db:
            db.execute(f"UPDATE batches SET {assignments} WHERE id = ?", (*fields.values(), batch_id))

    def begin_batch(self, batch_id: str) -> str:
        """validating -> in_progress (a resumed batch keeps its state and times); the status now."""
        with self._sql() as db:
            db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ? WHERE id = ? AND status = 'validating'",
                       (int(time.time()), batch_id))
        return self.batch(batch_id)["status"]

    def cancel_batch(self, batch_id: str) -> dict:
        """validating or in_progress -> cancelling (the worker ends it: cancelled); final states
        are refused, as OpenAI refuses them."""
        with self._sql() as db:
            changed = db.execute(
                "UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? AND status IN ('validating', 'in_progress')",
                (int(time.time()), batch_id),
            ).rowcount
        batch = self.batch(batch_id)
        if not changed and batch["status"] != "cancelling":
            raise LlamabatchError(f"batch {batch_id} is {batch['status']}: only a validating or in-progress batch can be cancelled")
        return batch

    def _page(self, table: str, where: str, args: list, limit: int, after: str | None, ascending: bool):
        """OpenAI's cursor pages: up to `limit` rows after the row with id `after`, and whether more follow."""
        order, cmp = ("ASC", ">") if ascending else ("DESC", "<")
        with self._sql() as db:
            if after is not None:
                cursor = db.execute(f"SELECT rowid FROM {table} WHERE id = ?", (after,)).fetchone()
                if cursor is None:  # a bad cursor is the caller's mistake, not a missing resource
                    raise LlamabatchError(f"after: no {ROW_NOUN[table]} with id {after!r}")
                where, args = f"{where} AND rowid {cmp} ?", [*args, cursor[0]]
            rows = db.execute(f"SELECT * FROM {table} WHERE {where} ORDER BY rowid {order} LIMIT ?", (*args, limit + 1)).fetchall()
        return rows[:limit], len(rows) > limit


def batch_object(row: dict, model: str | None) -> dict:
    """A stored batch as OpenAI's Batch object."""
    errors = json.loads(row["errors"]) if row["errors"] else None
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"], "model": model,
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"], "status": row["status"],
        "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        "created_at": row["created_at"], "expires_at": row["expires_at"], **{name: row[name] for name in _TIMESTAMPS},
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "usage": {"input_tokens": row["input_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": row["output_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": row["input_tokens"] + row["output_tokens"]},
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
    }


def page(data: list[dict], more: bool) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def _row(stored: StoredFile) -> tuple:
    return stored.id, stored.filename, stored.purpose, stored.bytes, stored.created_at, str(stored.path)


def _file(row: sqlite3.Row) -> StoredFile:
    return StoredFile(*(row[name] for name in _FILE_FIELDS[:-1]), Path(row["path"]))
