"""`llamabatch batch`: a job file of any size through one engine, with bounded memory.

The input is read lazily and only a window of requests (a small multiple of the slots) is
tokenized and queued at a time. Each request's result is appended to the output as soon as its
last sequence finishes (completion order; every line carries its id), failures go to an error
file, and a run over the same output skips every id already written, so a killed job resumes.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..engine import BatchEngine, SamplingParams, Sequence, Status
from ..errors import LlamabatchError
from ..openai_format import engine_inputs, usage
from .inputs import STDIN, BadLine, Format, JobRequest, RequestReader, peek_ids
from .ledger import IdSet, JsonlLog, digest, find_duplicate
from .manifest import Manifest
from .records import error_record, result_record

WINDOW_PER_SLOT = 2  # sequences queued or running per slot: enough that a freed slot never waits


@dataclass
class JobSummary:
    """Counts for one run of a job (a resumed run counts what it skipped apart)."""

    total: int | None  # requests in the input; None when it is read from standard input
    done: int = 0  # answered and written to the output by this run
    skipped: int = 0  # already in the output (or the error file) from an earlier run
    failed: int = 0  # written to the error file by this run
    prompt_tokens: int = 0
    completion_tokens: int = 0
    decode_calls: int = 0
    mean_active_sequences: float = 0.0
    wall_s: float = 0.0
    stopped_by: str | None = None  # the signal that stopped the job before its end

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def complete(self) -> bool:
        return self.stopped_by is None

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 2), "wall_s": round(self.wall_s, 3),
                "mean_active_sequences": round(self.mean_active_sequences, 3)}


class _Stopped(Exception):
    """A stop signal arrived before the job started decoding."""


@dataclass(eq=False)
class _Open:
    """A request in the engine: its sequences, and how many have not finished yet."""

    request: JobRequest
    sequences: list[Sequence] = field(default_factory=list)
    n_open: int = 0


class BatchJob:
    """Runs one input file through `engine`, writing `output` and an error file beside it.

    >>> with BatchEngine("gemma3-270m", n_parallel=16) as engine:
    ...     summary = BatchJob(engine, "requests.jsonl", "results.jsonl").run()
    """

    def __init__(
        self,
        engine: BatchEngine,
        input: str | Path,
        output: str | Path,
        *,
        errors: str | Path | None = None,
        base: SamplingParams | None = None,
        retry_errors: bool = False,
        overwrite: bool = False,
        window: int | None = None,
        on_progress: Callable[[JobSummary], None] | None = None,
    ) -> None:
        self.engine = engine
        self.input = input
        self.output = Path(output)
        self.errors = Path(errors) if errors is not None else self.output.with_name(self.output.name + ".errors.jsonl")
        if str(input) != STDIN and Path(input).resolve() in (self.output.resolve(), self.errors.resolve()):
            raise LlamabatchError(f"the output {self.output} would overwrite the input")
        self.reader = RequestReader(input, base)
        self.format = self.reader.format
        if base is not None and self.format is Format.OPENAI:
            self.reader.close()
            raise LlamabatchError(
                "sampling options (--max-tokens, --temperature, ...) apply to prompt files: "
                "the bodies of an OpenAI batch file carry their own"
            )
        self.base = base or SamplingParams()
        self.retry_errors = retry_errors
        self.overwrite = overwrite
        self.window = window or WINDOW_PER_SLOT * engine.config.n_parallel
        self.on_progress = on_progress or (lambda summary: None)
        self.summary = JobSummary(total=None)
        self._out = JsonlLog(self.output)
        self._err = JsonlLog(self.errors)
        self._open: dict[int, _Open] = {}  # sequence uid -> its request
        self._n_open_sequences = 0
        self._stop_signals: list[str] = []  # set by signal handlers, acted on between steps
        self._stopping = False
        self._created = int(time.time())

    # -- stopping (safe to call from a signal handler: it only records the request) ----------

    def request_stop(self, reason: str = "stop") -> None:
        """First call: admit nothing more and let running sequences finish. Second: drop them."""
        self._stop_signals.append(reason)

    # -- the run -------------------------------------------------------------------------

    def run(self) -> JobSummary:
        started = time.perf_counter()
        stats_before = (self.engine.stats.decode_calls, self.engine.stats.sequence_slots)
        try:
            self.summary.total = self._check_ids()
            self._loop(self._not_done(self._resume()))
        except _Stopped:
            pass
        finally:
            self.reader.close()
            self._out.close()
            self._err.close()
            s, (calls, slots) = self.summary, stats_before
            s.stopped_by = self._stop_signals[0] if self._stop_signals else None
            s.wall_s = time.perf_counter() - started
            s.decode_calls = self.engine.stats.decode_calls - calls
            s.mean_active_sequences = (self.engine.stats.sequence_slots - slots) / s.decode_calls if s.decode_calls else 0.0
        return self.summary

    def _check_ids(self) -> int | None:
        """Count the input's requests and refuse a repeated id before any work (not for stdin).
        A stop signal ends this pass too: a file of millions of lines takes a while."""
        if str(self.input) == STDIN:
            return None

        def pairs() -> Iterator[tuple[str, int]]:
            for pair in peek_ids(self.input, self.format):
                if self._stop_signals:
                    raise _Stopped
                yield pair

        total, duplicate = find_duplicate(pairs)
        if duplicate:
            id_, first, second = duplicate
            raise LlamabatchError(f"duplicate id {id_!r} on lines {first} and {second} of {self.input}: ids must be unique")
        return total

    def _resume(self) -> IdSet:
        """Open the output files, and return the ids a run before this one already answered."""
        manifest = Manifest.for_job(self.engine, self.format, self.base, self.output)
        if self.overwrite:
            manifest.write()
            self._out.open(fresh=True)
            self._err.open(fresh=True)
            return IdSet()
        manifest.check_or_write()
        done = IdSet.of(self._recorded_ids())
        self._out.open(fresh=False)
        self._err.open(fresh=self.retry_errors)  # retried ids write new failures if they fail again
        return done

    def _recorded_ids(self) -> Iterator[str]:
        yield from self._out.recorded(self.format.id_field)
        if not self.retry_errors:
            yield from self._err.recorded(self.format.id_field)

    def _not_done(self, done: IdSet) -> Iterator[JobRequest | BadLine]:
        seen: set[bytes] | None = set() if self.summary.total is None else None  # stdin: duplicates found as they come
        for item in self.reader:
            if item.id in done:
                self.summary.skipped += 1
                continue
            if seen is not None:
                key = digest(item.id)
                if key in seen:
                    item = BadLine(item.id, item.line, f"duplicate id {item.id!r}: an earlier line has it")
                seen.add(key)
            yield item

    def _loop(self, requests: Iterator[JobRequest | BadLine]) -> None:
        exhausted = False
        while True:
            self._act_on_signals()
            while not (exhausted or self._stopping) and self._n_open_sequences < self.window:
                item = next(requests, None)
                if item is None:
                    exhausted = True
                elif isinstance(item, BadLine):
                    self._fail(item.id, item.line, item.message, item.status)
                else:
                    self._submit(item)
            if not self.engine.has_work:
                if exhausted or self._stopping:
                    break
                continue
            finished = [e for e in self.engine.step() if e.finish_reason is not None]
            for event in finished:
                self._finished(event.uid)
            if finished:
                self.on_progress(self.summary)

    def _act_on_signals(self) -> None:
        if not self._stop_signals:
            return
        if not self._stopping:  # first: requests not yet running are left for a resumed run
            self._stopping = True
            self._drop(lambda req: any(s.status is Status.WAITING for s in req.sequences))
        if len(self._stop_signals) > 1:  # second: drop the running ones too
            self._drop(lambda req: True)

    def _drop(self, which: Callable[[_Open], bool]) -> None:
        for req in set(self._open.values()):
            if which(req):
                for seq in req.sequences:
                    self.engine.cancel(seq)
                    self._open.pop(seq.uid, None)
                self._n_open_sequences -= req.n_open

    # -- one request -------------------------------------------------------------------

    def _submit(self, request: JobRequest) -> None:
        """Queue the request's prompts; one that cannot run fails the request alone."""
        req = _Open(request)
        try:
            prompts, params = (
                engine_inputs(request.body, self.engine) if request.body is not None else ([request.prompt], request.params)
            )
            for i, prompt in enumerate(prompts):
                try:
                    req.sequences += self.engine.add(prompt, params, index=i)
                except LlamabatchError as e:
                    raise LlamabatchError(f"prompt {i}: {e}" if len(prompts) > 1 else str(e)) from None
        except LlamabatchError as e:
            for seq in req.sequences:
                self.engine.cancel(seq)
            self._fail(request.id, request.line, str(e), 400)
            return
        open_sequences = [seq for seq in req.sequences if seq.finish_reason is None]  # max_tokens 0 ends some at once
        if not open_sequences:
            self._write(req)
            return
        req.n_open = len(open_sequences)
        self._n_open_sequences += req.n_open
        for seq in open_sequences:
            self._open[seq.uid] = req

    def _finished(self, uid: int) -> None:
        req = self._open.pop(uid, None)
        if req is None:
            return
        req.n_open -= 1
        self._n_open_sequences -= 1
        if req.n_open:
            return
        failed = next((s for s in req.sequences if s.error), None)
        if failed is not None:
            self._fail(req.request.id, req.request.line, failed.error, 500)
        else:
            self._write(req)

    def _write(self, req: _Open) -> None:
        self._out.write(result_record(self.format, req.request, req.sequences, self.engine, self._created))
        counted = usage(req.sequences)
        self.summary.done += 1
        self.summary.prompt_tokens += counted["prompt_tokens"]
        self.summary.completion_tokens += counted["completion_tokens"]

    def _fail(self, id_: str, line: int, message: str, status: int | None) -> None:
        self._err.write(error_record(self.format, id_, line, message, status))
        self.summary.failed += 1


@contextmanager
def stop_on_signals(job: BatchJob) -> Iterator[None]:
    """SIGINT and SIGTERM ask the job to stop (twice: at once) instead of killing the process,
    so what finished is written and the job can resume. Only the main thread can install them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: job.request_stop(signal.Signals(signum).name)) for s in handled}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
