"""One thread owns the engine and steps it; requests from other threads reach it through an inbox.

The engine (and the llama.cpp context under it) is touched only by the worker thread. Callers
submit prompts and get a Submission back; each step's events reach the callers' event loop in
one delivery (one wake-up of the loop per step, not one per token), which puts each Submission's
share of them on its asyncio queue as one list. Cancelling a Submission frees its sequences at
the next step. The metrics hear of a step once, with what its tokens add up to (StepReport).

A step that fails fails its own sequences (the engine reports them) and the thread goes on. If
the engine breaks, every open and queued request fails at once, later ones are refused, and
`broken` says why; the engine is closed only when the worker stops, so nothing reads freed memory.

Stopping goes in order (serve/shutdown.py): intake stops (refuse), the requests still open end
with an error (end_requests), the thread is joined within a timeout, batches are synced and left
in progress for the next start, and the engine is closed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..engine import BatchEngine, Event, Result, SamplingParams, Sequence, Ticket
from ..engine.embedding import Pooling
from ..engine.snapshot import IDLE, EngineFacts, EngineSnapshot
from ..errors import EngineBroken, LlamabatchError
from .batch_runs import BatchRun

T = TypeVar("T")


log = logging.getLogger("llamabatch.serve")

STOPPING = "the server is stopping"  # why requests are refused, and those still open end, as it stops

# A client whose stream has this many steps' events it has not read has stopped reading: its
# sequences are cancelled rather than generated into a buffer nobody empties.
MAX_UNREAD_STEPS = 256
RECENT_FAILURES = 20  # the web page lists this many of the latest


@dataclass(frozen=True)
class Failure:
    """A request that failed in the engine (not one refused for what it asked), or the engine
    itself, as the web page lists it."""

    time: float  # the wall clock's
    where: str  # the priority class of the sequence that failed (interactive, batch), embeddings, or engine
    message: str


class QueueFull(LlamabatchError):
    """More sequences are waiting than the server's --max-queue allows (for now: retry later)."""


class TooLarge(LlamabatchError):
    """A request with more sequences than --max-queue: it could never be queued."""


class EngineUnavailable(LlamabatchError):
    """The engine has stopped (see EngineWorker.broken): nothing more can run."""


@dataclass(eq=False)
class Submission:
    """One caller's sequences as tickets, and the queue their events arrive on (a list per step);
    the last event of each carries its Result. What the engine thread hands over is immutable:
    nothing on the caller's side touches a Sequence."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[list[Event]] = field(default_factory=asyncio.Queue)
    tickets: tuple[Ticket, ...] = ()  # in the engine's order: prompts in order, each prompt's n samples together
    ended: tuple[Result, ...] = ()  # the sequences that ended as they were taken (refused; max_tokens 0)
    submitted: asyncio.Future | None = None  # resolves once the engine has taken the prompts
    n_open: int = 0  # sequences that will send events: counted when taken, before any step runs
    t_start: float = field(default_factory=time.perf_counter)
    priority: int = 0  # lower runs first (queue.rank)
    streamed: bool = True  # its tokens are sent as they come (Sequence.streamed): else it is answered whole


@dataclass(eq=False)
class PoolingSubmission:
    """One caller's texts to embed (or pairs to score): `tokens` makes their token lists in the
    worker thread, and `done` gets (pooled rows, tokens) or the error. Requests that wait
    together share decodes."""

    loop: asyncio.AbstractEventLoop
    tokens: Callable[[BatchEngine], list[list[int]]]
    pooling: Pooling | None
    done: asyncio.Future


@dataclass
class StepReport:
    """What one engine step did, summed for the metrics: they are updated once a step."""

    n_sequences: int  # in its llama_decode
    seconds: float
    prompt_tokens: int = 0  # prompt tokens it decoded (the step budget's work beside the decoders)
    tokens: dict[str, int] = field(default_factory=dict)  # tokens sampled, by priority class
    first_tokens: list[tuple[str, float]] = field(default_factory=list)  # (class, seconds since submitted) of each first token
    gaps: list[float] = field(default_factory=list)  # seconds since each sequence's previous token
    finished: list[Result] = field(default_factory=list)  # the sequences it ended


@dataclass
class Observer:
    """Hooks the worker calls from its thread (the server feeds its metrics from them)."""

    on_step: Callable[[StepReport], None] = lambda report: None


class EngineWorker:
    def __init__(self, load: Callable[[], BatchEngine], max_queue: int, observer: Observer | None = None) -> None:
        self._load = load
        self.max_queue = max_queue
        self.observer = observer or Observer()
        self.engine: BatchEngine | None = None
        self.load_error: BaseException | None = None
        self.broken: str | None = None  # why the engine stopped serving, once it has
        self.stopping: str | None = None  # why it takes no more work, once the server stops
        self.failures: tuple[Failure, ...] = ()  # the latest, oldest first: replaced whole by the worker thread
        self.ready = threading.Event()
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._pooling: list[PoolingSubmission] = []  # taken, run after the inbox is drained
        self._batches: list[BatchRun] = []  # server-side batches in progress, fed between steps
        self._owners: dict[int, tuple[Submission, Sequence]] = {}  # sequence uid -> its submission, and itself
        self._last_token_at: dict[int, float] = {}
        self._pending = 0  # sequences submitted but not yet taken by the worker thread
        self._pending_lock = threading.Lock()  # both threads update it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llamabatch-engine", daemon=True)

    # -- called from other threads ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def refuse(self, reason: str) -> None:
        """Take no more work: every later submission is refused with `reason` (EngineUnavailable);
        what was submitted before goes on."""
        with self._pending_lock:
            self.stopping = self.stopping or reason

    def end_requests(self, reason: str) -> None:
        """End every request still open (not batches) with `reason` as its error, at the next step."""
        self._inbox.put(lambda: self._fail_requests(reason, cancel=True))

    @property
    def refusal(self) -> str | None:
        """Why new work is refused: the engine broke, or the server is stopping."""
        return self.broken or self.stopping

    @property
    def serving_requests(self) -> bool:
        """Requests (not batches) queued or open (read from another thread: a snapshot)."""
        return bool(self._pending or self._owners or self._pooling)

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the thread (within `timeout` seconds), then sync the batches in progress (left so:
        the next start resumes them) and close the engine. A request still open ends with an
        error. False when the thread did not stop in time (a long decode, say): its engine and
        batches are left as they are, to go with the process, not freed under a running step."""
        self.refuse(STOPPING)
        self._stop.set()
        self._inbox.put(lambda: None)  # wake it
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine thread did not stop within %.0f s; its engine is left to the process's exit", timeout)
            return False
        for run in self._batches:  # synced, and left in progress: the next start resumes them
            run.close()
        if self.engine is not None:
            engine, self.engine = self.engine, None  # what reads it from now on sees no engine, not a closed one
            engine.close()
        return True

    @property
    def snapshot(self) -> EngineSnapshot:
        """The engine's state as it last published it (IDLE when none is loaded): any thread may
        read it, and it stays valid when the engine is closed."""
        engine = self.engine
        return engine.snapshot if engine is not None else IDLE

    @property
    def facts(self) -> EngineFacts | None:
        """The loaded engine's settings (None when none is loaded)."""
        engine = self.engine
        return engine.facts if engine is not None else None

    @property
    def queued(self) -> int:
        """Interactive sequences waiting for a slot, including those not yet handed to the engine
        (--max-queue bounds these; batch work waits in its batches' files). Never fewer than
        there are: a request counts as pending until the snapshot shows it waiting."""
        return self._pending + self.snapshot.waiting["interactive"]

    @property
    def busy(self) -> bool:
        """Work in flight: requests not yet taken, sequences, embeddings or batches (read from
        another thread: a snapshot, which a request's lease covers until its work is taken)."""
        return bool(self._pending or not self._inbox.empty() or self._pooling or self._batches or self.snapshot.has_work)

    @property
    def n_batches(self) -> int:
        return len(self._batches)

    def submit(self, submission: Submission, prompts: list, params: list[SamplingParams]) -> None:
        """Queue prompts for `request`. Raises TooLarge when no queue could take them all,
        QueueFull when this one cannot now, EngineUnavailable when the engine has stopped."""
        n = sum(p.n for p in params)
        if n > self.max_queue:
            raise TooLarge(
                f"the request asks for {n} sequences (prompts x n) and the server queues at most {self.max_queue} "
                "(--max-queue): split it"
            )
        submission.submitted = submission.loop.create_future()
        with self._pending_lock:  # held while queueing, so _break either sees this job or refuses it here
            if self.refusal is not None:
                raise EngineUnavailable(self.refusal)
            if self.queued + n > self.max_queue:
                raise QueueFull(f"the queue is full ({self.queued} sequences waiting, --max-queue {self.max_queue})")
            self._pending += n
            self._inbox.put(lambda: self._take(submission, prompts, params))

    def cancel(self, submission: Submission) -> None:
        self._inbox.put(lambda: self._cancel(submission))

    def run_batch(self, run: BatchRun) -> None:
        """Feed a started batch's requests into the engine between steps until it is done."""
        self._inbox.put(lambda: self._add_batch(run))

    def cancel_batch(self, batch_id: str) -> None:
        self._inbox.put(lambda: [run.stop("cancelled") for run in self._batches if run.id == batch_id])

    async def call(self, action: Callable[[BatchEngine], T]) -> T:
        """Run `action` on the engine's thread between steps (it may change the engine: load an
        adapter, say), and answer with what it returned or raised."""
        if self.refusal is not None:
            raise EngineUnavailable(self.refusal)
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result = action(self.engine)
            except Exception as e:  # noqa: BLE001 - the caller's to answer
                loop.call_soon_threadsafe(_resolve, done, e)
            else:
                loop.call_soon_threadsafe(_resolve, done, None, result)

        self._inbox.put(run)
        return await done

    def pool(self, submission: PoolingSubmission) -> None:
        """Queue texts to embed or pairs to score: a waiting request counts as one in the queue
        (it may hold up to 2,048 texts). QueueFull when the queue is full, EngineUnavailable when
        the engine has stopped."""
        with self._pending_lock:
            if self.refusal is not None:
                raise EngineUnavailable(self.refusal)
            if self.queued + 1 > self.max_queue:
                raise QueueFull(f"the queue is full ({self.queued} sequences and requests waiting, --max-queue {self.max_queue})")
            self._pending += 1
            self._inbox.put(lambda: self._pooling.append(submission))

    # -- the worker thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._load()
        except BaseException as e:  # reported by /health; the server cannot serve without it
            self.load_error = e
            return
        finally:
            self.ready.set()
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self.engine.has_work and not self._batches)
                if self._pooling:
                    self._run_pooling()
                self._each_batch(BatchRun.feed)
                if self.engine.has_work:
                    self._step()
                if self.engine.broken is not None:
                    raise EngineBroken(self.engine.broken)
                for run in [r for r in self._batches if r.finished]:
                    self._batches.remove(run)
                    self._each_batch(BatchRun.finish, [run])
        except Exception as e:  # noqa: BLE001 - whatever it was, the requests must hear of it
            self._break(e)
        else:
            self._fail_requests(self.refusal or STOPPING, cancel=True)

    def _break(self, error: Exception) -> None:
        """The engine cannot go on: fail every request it holds or has queued, refuse the rest."""
        with self._pending_lock:
            self.broken = f"the engine stopped: {error}"
        self._failed("engine", self.broken)
        self._fail_requests(self.broken, cancel=False)
        runs, self._batches = self._batches, []
        for run in runs:
            run.fail(self.broken)

    def _fail_requests(self, reason: str, cancel: bool) -> None:
        """End every request with `reason` as its error: those still in the inbox are taken first
        (refused by _take if the engine broke), then every open one ends (`cancel`: its sequences
        freed in the engine, which goes on)."""
        self._drain_inbox(block=False)
        for submission, seq in list(self._owners.values()):
            event = (self.engine.cancel(seq, reason) if cancel else None) or self.engine.abandon(seq, reason)
            self._ended_outside_step(seq, event)
            submission.loop.call_soon_threadsafe(submission.events.put_nowait, [event])
        for pooling in self._pooling:
            pooling.loop.call_soon_threadsafe(_resolve, pooling.done, EngineUnavailable(reason))
        with self._pending_lock:
            self._pending -= len(self._pooling)
        self._pooling.clear()

    def _add_batch(self, run: BatchRun) -> None:
        if self.broken is not None:
            run.fail(self.broken)
            return
        self._batches.append(run)

    def _each_batch(self, action: Callable, runs: list[BatchRun] | None = None, *args) -> None:
        """Do `action` to each batch (default: every one in progress); one that raises (its files
        cannot be written, say) fails alone, the engine and the other batches go on."""
        for run in list(self._batches if runs is None else runs):
            try:
                action(run, *args)
            except Exception as e:  # noqa: BLE001 - the batch's API object says why it failed
                if run in self._batches:
                    self._batches.remove(run)
                    for seq in run.job.runner.open_sequences():
                        self.engine.cancel(seq)
                run.fail(f"the batch failed: {type(e).__name__}: {e}")

    def _drain_inbox(self, block: bool) -> None:
        try:
            job = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                job()
                job = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _take(self, submission: Submission, prompts: list, params: list[SamplingParams]) -> None:
        try:
            self._submit(submission, prompts, params)
        finally:  # (counted as pending until the snapshot counts them as waiting)
            with self._pending_lock:
                self._pending -= sum(p.n for p in params)

    def _submit(self, submission: Submission, prompts: list, params: list[SamplingParams]) -> None:
        if self.broken is not None:
            submission.loop.call_soon_threadsafe(_resolve, submission.submitted, EngineUnavailable(self.broken))
            return
        try:
            sequences = self.engine.submit(prompts, params, priority=submission.priority, streamed=submission.streamed)
        except Exception as e:  # e.g. a chat template the model cannot render
            submission.loop.call_soon_threadsafe(_resolve, submission.submitted, e)
            return
        self.engine.publish()
        submission.tickets = tuple(seq.ticket() for seq in sequences)
        submission.ended = tuple(seq.result() for seq in sequences if seq.finish_reason is not None)  # refused, or max_tokens 0
        for seq in sequences:
            if seq.finish_reason is None:
                self._owners[seq.uid] = (submission, seq)
                submission.n_open += 1
        submission.loop.call_soon_threadsafe(_resolve, submission.submitted, None)

    def _cancel(self, submission: Submission) -> None:
        if self.broken is not None:  # its sequences have failed already
            return
        for seq in [seq for owner, seq in list(self._owners.values()) if owner is submission]:
            event = self.engine.cancel(seq)
            if event is not None:
                self._ended_outside_step(seq, event)
                submission.loop.call_soon_threadsafe(submission.events.put_nowait, [event])

    def _run_pooling(self) -> None:
        """Every waiting embedding (and rerank) request, packed together into as few decodes as
        their texts fill, one pooling type at a time. A request whose input is refused fails
        alone; a decode that fails fails the requests it carried."""
        waiting, self._pooling = self._pooling, []
        with self._pending_lock:
            self._pending -= len(waiting)
        waiting = [r for r in waiting if not r.done.done()]  # its client timed out or left: no decode for it
        for pooling in {r.pooling for r in waiting}:
            taken: list[tuple[PoolingSubmission, list[list[int]]]] = []
            for submission in (r for r in waiting if r.pooling == pooling):
                try:
                    taken.append((submission, submission.tokens(self.engine)))
                except Exception as e:  # noqa: BLE001 - an input or model refused: this request's answer
                    submission.loop.call_soon_threadsafe(_resolve, submission.done, e)
            if not taken:
                continue
            try:
                answers = self.engine.embedder(pooling).embed_groups([lists for _, lists in taken])
            except Exception as e:  # noqa: BLE001 - the decode failed: the requests it carried hear why
                self._failed("embeddings", str(e))
                for submission, _ in taken:
                    submission.loop.call_soon_threadsafe(_resolve, submission.done, e)
                continue
            for (submission, lists), rows in zip(taken, answers):
                submission.loop.call_soon_threadsafe(_resolve, submission.done, None, (rows, sum(map(len, lists))))

    def _step(self) -> None:
        stats = self.engine.stats
        slots_before, prompt_before = stats.sequence_slots, stats.prompt_tokens_evaluated
        started = time.perf_counter()
        events = self.engine.step()
        now = time.perf_counter()
        report = StepReport(stats.sequence_slots - slots_before, now - started, stats.prompt_tokens_evaluated - prompt_before)
        deliveries: dict[asyncio.AbstractEventLoop, dict[Submission, list[Event]]] = {}
        for event in events:
            owner = self._owners.get(event.uid)
            if owner is None:
                self._deliver_to_batch(event, now, report)
                continue
            submission, seq = owner
            self._observe(seq, event, now, report)
            deliveries.setdefault(submission.loop, {}).setdefault(submission, []).append(event)
        for loop, lists in deliveries.items():
            loop.call_soon_threadsafe(_put_each, lists)
            for submission in lists:
                if submission.events.qsize() > MAX_UNREAD_STEPS:
                    self._cancel(submission)
        self.observer.on_step(report)

    def _deliver_to_batch(self, event: Event, now: float, report: StepReport) -> None:
        for run in self._batches:
            seq = run.job.runner.sequence(event.uid)
            if seq is not None:
                self._observe(seq, event, now, report)
                if event.finish_reason is not None:
                    self._each_batch(BatchRun.on_event, [run], event)
                return

    def _observe(self, seq: Sequence, event: Event, now: float, report: StepReport) -> None:
        """A step's event in the metrics. A sequence answered whole sends only its last event:
        its tokens and first token are counted then, from its Result, and it has no gaps."""
        if not seq.streamed:
            if event.result is not None:
                self._observe_whole(seq, event.result, report)
        elif event.token is not None:
            cls = seq.priority_class
            report.tokens[cls] = report.tokens.get(cls, 0) + 1
            last = self._last_token_at.get(event.uid)
            if last is None:
                report.first_tokens.append((cls, now - seq.t_submitted))
            else:
                report.gaps.append(now - last)
            self._last_token_at[event.uid] = now
        if event.finish_reason is not None:
            if event.finish_reason == "error":
                self._failed(seq.priority_class, event.error or "error")
            self._forget(event, report)

    @staticmethod
    def _observe_whole(seq: Sequence, result: Result, report: StepReport) -> None:
        cls = seq.priority_class
        if result.completion_tokens:
            report.tokens[cls] = report.tokens.get(cls, 0) + result.completion_tokens
        if result.timings is not None:
            report.first_tokens.append((cls, result.timings.ttft_s))

    def _failed(self, where: str, message: str) -> None:
        self.failures = (*self.failures, Failure(time.time(), where, message))[-RECENT_FAILURES:]

    def _forget(self, last: Event, report: StepReport) -> None:
        """A sequence's last event (it carries its Result) is out: the worker holds it no more."""
        assert last.result is not None, "a last event carries its sequence's result"
        self._owners.pop(last.uid, None)
        self._last_token_at.pop(last.uid, None)
        report.finished.append(last.result)

    def _ended_outside_step(self, seq: Sequence, last: Event) -> None:
        """A sequence ended outside a step (cancelled, the engine broke): a report of its own."""
        report = StepReport(0, 0.0)
        if not seq.streamed and last.result is not None:
            self._observe_whole(seq, last.result, report)
        self._forget(last, report)
        self.observer.on_step(report)


def _put_each(lists: dict[Submission, list[Event]]) -> None:
    """On the event loop: each submission's events of one step, as one item of its queue."""
    for submission, events in lists.items():
        submission.events.put_nowait(events)


def _resolve(future: asyncio.Future, error: BaseException | None, result=None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
