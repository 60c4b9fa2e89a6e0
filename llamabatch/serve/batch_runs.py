"""Server-side batches (OpenAI's Batch API) on the jobs wing, inside the server's own engine.

A batch is validated as OpenAI validates one (every line a JSON request for the batch's
endpoint, custom_ids unique; otherwise the batch fails with the lines' errors), then becomes a
BatchJob over the uploaded file, writing its output and error lines into the batch's folder as
`llamabatch batch` writes them. The engine worker feeds each running batch's requests into the
engine at batch priority between steps, so batch work fills the slots interactive requests leave
free. A server killed mid-batch resumes it from its output when it starts again: every request
ends in the output or the error file exactly once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..embeddings_format import EMBEDDINGS_URL
from ..engine import BatchEngine, Event
from ..engine.scheduling.queue import BATCH_PRIORITY
from ..errors import LlamabatchError
from ..jobs import BatchJob
from ..jobs.inputs import BadLine, JobLine, numbered_lines
from ..jobs.ledger import find_duplicate
from ..jobs.runner import Outcome
from ..openai_format import ENDPOINTS
from .store import Store

BATCH_ENDPOINTS = (*ENDPOINTS, EMBEDDINGS_URL)
MAX_LISTED_ERRORS = 100  # a failed validation lists at most this many lines' errors
COUNTS_SAVE_INTERVAL_S = 1.0  # request counts reach SQLite at most this often while a batch runs


def validate(path, endpoint: str) -> tuple[int, list[dict]]:
    """(requests, errors) of a batch input, as OpenAI checks one before it runs: each line a JSON
    object with a string custom_id, method POST, url the batch's endpoint and a body object, and
    no custom_id twice. Bodies are checked when each request runs (a bad one fails alone)."""
    errors: list[dict] = []
    n_lines = 0

    def fail(line: int, code: str, message: str, param: str | None = None) -> None:
        if len(errors) < MAX_LISTED_ERRORS:
            errors.append({"code": code, "line": line, "message": message, "param": param})

    def ids() -> Iterator[tuple[str, int]]:
        nonlocal n_lines
        for n, text in numbered_lines(path):
            n_lines += 1
            custom_id, problem = _checked_line(text, endpoint)
            if problem is not None:
                fail(n, *problem)
            else:
                yield custom_id, n

    _, duplicate = find_duplicate(ids)
    if duplicate:
        id_, first, second = duplicate
        fail(second, "duplicate_custom_id", f"custom_id {id_!r} is on line {first} too: custom_ids must be unique", "custom_id")
    if n_lines == 0:
        fail(0, "empty_file", "the input file holds no requests")
    return n_lines, errors


def _checked_line(text: str | None, endpoint: str) -> tuple[str | None, tuple[str, str, str | None] | None]:
    """(custom_id, None) for a line a batch can run, else (None, (code, message, param))."""
    if text is None:
        return None, ("invalid_json_line", "the line is not UTF-8 text", None)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, ("invalid_json_line", f"the line is not JSON: {e.msg}", None)
    if not isinstance(obj, dict):
        return None, ("invalid_json_line", "the line is not a JSON object", None)
    if not isinstance(obj.get("custom_id"), str) or not obj["custom_id"]:
        return None, ("missing_required_parameter", "each line needs a custom_id string", "custom_id")
    if obj.get("method") != "POST":
        return None, ("invalid_request", f"method must be 'POST', got {obj.get('method')!r}", "method")
    if obj.get("url") != endpoint:
        return None, ("mismatched_endpoint", f"url {obj.get('url')!r} is not the batch's endpoint {endpoint!r}", "url")
    if not isinstance(obj.get("body"), dict):
        return None, ("missing_required_parameter", "each line needs a body object", "body")
    return obj["custom_id"], None


def batch_error(code: str, message: str) -> dict:
    """One entry of a failed batch's errors.data, for the batch as a whole (no line)."""
    return {"code": code, "line": None, "message": message, "param": None}


@dataclass(eq=False)
class BatchRun:
    """One batch in progress: its job (files, ledger, runner) and the counts the API reports."""

    id: str
    job: BatchJob
    requests: Iterator[JobLine | BadLine]
    store: Store
    expires_at: int
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    ending: str | None = None  # "cancelled" or "expired" once told to stop early
    _saved_at: float = 0.0  # when the counts last reached SQLite (monotonic)

    @classmethod
    def start(cls, store: Store, engine: BatchEngine, row: dict) -> BatchRun:
        """A validated batch's job, resuming from whatever an earlier server wrote to its output.
        Reads no engine state but its settings: safe off the engine's thread. Raises
        LlamabatchError when the output belongs to another job (the model file changed, say)."""
        folder = store.batch_dir(row["id"])
        folder.mkdir(parents=True, exist_ok=True)
        source = store.file(row["input_file_id"]).path
        job = BatchJob(engine, source, folder / "output.jsonl", errors=folder / "errors.jsonl", priority=BATCH_PRIORITY)
        try:
            requests = job.pending(job.prepare())
            completed = _lines(job.output)
            failed = _lines(job.errors)
        except BaseException:
            job.close()
            raise
        run = cls(row["id"], job, requests, store, row["expires_at"], completed, failed, row["input_tokens"], row["output_tokens"])
        store.update_batch(run.id, total=job.summary.total, completed=completed, failed=failed)
        if store.begin_batch(run.id) == "cancelling":  # cancelled meanwhile, or before a restart
            run.stop("cancelled")
        return run

    # -- on the engine's thread ------------------------------------------------------------

    def feed(self) -> None:
        """Between steps: queue requests while the job's window has room."""
        if self.ending is None and time.time() >= self.expires_at:
            self.stop("expired")
        for outcome in self.job.runner.feed(self.requests):
            self._record(outcome)

    def on_event(self, event: Event) -> None:
        for outcome in self.job.runner.on_event(event):
            self._record(outcome)

    def stop(self, ending: str) -> None:
        """Cancel or expire: nothing more is queued; running requests finish and are written."""
        if self.ending is None:
            self.ending = ending
            self.job.request_stop(ending)

    @property
    def finished(self) -> bool:
        return self.job.runner.finished

    # The engine thread is done with a batch once it ends: closing its files (fsync) and its
    # row's last writes go to the store's writer thread, in order after its earlier writes.

    def finish(self) -> None:
        """Close the files and publish them: completed, cancelled or expired."""
        if self.ending is None:
            counts = self._counts()
            self.store.later(lambda: self.store.update_batch(self.id, status="finalizing", **counts))
        self.store.later(lambda: self._end(self.ending or "completed"))

    def fail(self, message: str) -> None:
        """The engine stopped (or the files could not be written): the batch fails, what it wrote kept."""
        self.store.later(lambda: self._end("failed", errors=[batch_error("engine_failed", message)]))

    def close(self) -> None:
        """The server is stopping: files synced, the batch left in progress for the next start."""
        self.job.close()
        counts = self._counts()
        self.store.later(lambda: self.store.update_batch(self.id, **counts))

    def _end(self, status: str, **fields) -> None:
        try:
            self.job.close()
            published = self._publish()
        except Exception as e:  # its files cannot be written: the batch says so, it does not stay in progress
            self.store.update_batch(self.id, status="failed", errors=[batch_error("batch_failed", f"{type(e).__name__}: {e}")],
                                    **self._counts())
            raise
        self.store.update_batch(self.id, status=status, **fields, **self._counts(), **published)

    def _record(self, outcome: Outcome) -> None:
        self.job.record(outcome)
        if outcome.ok:
            self.completed += 1
            self.input_tokens += outcome.prompt_tokens
            self.output_tokens += outcome.completion_tokens
        else:
            self.failed += 1
        now = time.monotonic()
        if now - self._saved_at >= COUNTS_SAVE_INTERVAL_S:
            counts = self._counts()
            self.store.later(lambda: self.store.update_batch(self.id, **counts))
            self._saved_at = now

    def _counts(self) -> dict:
        return {"completed": self.completed, "failed": self.failed, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens}

    def _publish(self) -> dict:
        """The output and error files as files of purpose batch_output (those with lines)."""
        ids = {}
        for key, path, name in (("output_file_id", self.job.output, "output"), ("error_file_id", self.job.errors, "error")):
            if path.exists() and path.stat().st_size:
                file_id, _ = self.store.new_file_path()
                ids[key] = self.store.add_file(file_id, f"{self.id}_{name}.jsonl", "batch_output", path).id
        return ids


def _lines(path: Path) -> int:
    """Lines an earlier run wrote: prepare() has read them all and cut any torn tail, so each
    line is a whole record and counting them is enough."""
    if not path.exists():
        return 0
    with path.open("rb") as f:
        return sum(1 for _ in f)


def validated_run(store: Store, engine: BatchEngine, row: dict) -> BatchRun | None:
    """Validate a batch's input (status validating), then start its job: the run, or None when
    the batch failed validation or was cancelled meanwhile (its state says which)."""
    if row["status"] == "validating":
        total, errors = validate(store.file(row["input_file_id"]).path, row["endpoint"])
        if errors:
            store.update_batch(row["id"], status="failed", errors=errors, total=total)
            return None
        store.update_batch(row["id"], total=total)
    row = store.batch(row["id"])
    if row["status"] == "cancelling" and row["in_progress_at"] is None:  # cancelled before it started
        store.update_batch(row["id"], status="cancelled")
        return None
    try:
        return BatchRun.start(store, engine, row)
    except LlamabatchError as e:
        store.update_batch(row["id"], status="failed", errors=[batch_error("invalid_request", str(e))])
        return None
