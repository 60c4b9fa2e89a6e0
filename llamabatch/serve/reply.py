"""One request's events, as every dialect reads them: each step's events as they come, the
answer's deltas, the wait for the end; cancelled when the client leaves or the request times out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import HTTPException, Request as HttpRequest

from ..chat.conversation import Answer
from ..engine import BatchEngine, Event, Result
from ..openai_format import ChatRequest, EngineInputs, SamplingFields, Shown, failure, new_id
from .metrics import RequestCounters
from .worker import EngineWorker, Submission


@dataclass(frozen=True)
class Translated:
    """A request of any dialect as the engine runs it: the OpenAI request it means (its model,
    priority and messages), the engine's inputs, the OpenAI object its answer is made from
    (`kind`), and what that shows."""

    request: SamplingFields | ChatRequest
    inputs: EngineInputs
    kind: str = "chat.completion"
    shown: Shown = Shown()


class Reply:
    """A request's submission and what its answer is made of (Translated)."""

    def __init__(self, submission: Submission, engine: BatchEngine, translated: Translated, timeout: float, counters: RequestCounters) -> None:
        self.submission, self.request, self.kind, self.shown = submission, translated.request, translated.kind, translated.shown
        self.timeout, self.counters = timeout, counters
        # the model the request named (an adapter's name answers as that adapter, as vLLM does)
        self.model = translated.request.model or engine.model_name
        self.answer = translated.inputs.answer or Answer()
        self.vocab = engine.vocab  # pieces are cached and read-only: safe beside the engine thread
        self.id = new_id(self.kind)
        self.created = int(time.time())
        self.n_open = submission.n_open  # counted by the engine thread: those that finish by now still send their events
        self._ended = {result.uid: result for result in submission.ended}  # and each last event's Result, as it comes

    @property
    def results(self) -> list[Result]:
        """The sequences that have ended, in the engine's order (prompts in order, each one's samples together)."""
        return [self._ended[t.uid] for t in self.submission.tickets if t.uid in self._ended]

    async def events(self, worker: EngineWorker, http: HttpRequest | None = None) -> AsyncIterator[Event]:
        """This request's events until every sequence has finished; cancels them if the client
        leaves, the request times out, or the consumer stops early."""
        deadline = self.submission.t_start + self.timeout
        next_check = time.perf_counter() + 0.5
        try:
            while self.n_open:
                now = time.perf_counter()
                if now > deadline:
                    raise HTTPException(504, f"the request took longer than {self.timeout:g} s")
                if http is not None and now >= next_check:  # a waiting client that hung up
                    if await http.is_disconnected():
                        return
                    next_check = now + 0.5
                try:
                    async with asyncio.timeout(0.5):  # (no task per wait, as wait_for makes)
                        events = await self.submission.events.get()
                except TimeoutError:
                    continue
                for event in events:  # one step's
                    if event.result is not None:
                        self._ended[event.uid] = event.result
                        self.n_open -= 1
                    yield event
        finally:
            if self.n_open:
                worker.cancel(self.submission)
                self.counters.failed.inc()
            else:
                self.counters.finished.inc()

    async def answer_deltas(self, worker: EngineWorker) -> AsyncIterator[dict]:
        """A one-sequence chat request's answer as it comes, as Answer.stream's deltas
        (reasoning_content, content, tool_calls); an HTTPException once it has failed."""
        stream = self.answer.stream()
        async for event in self.events(worker):
            if event.finish_reason is not None:
                self.raise_if_failed()
            if event.text or event.finish_reason:
                for delta in stream.feed(event.text, final=event.finish_reason is not None):
                    yield delta

    async def drain(self, worker: EngineWorker, http: HttpRequest) -> None:
        """Wait for every sequence to finish; an HTTPException when the request failed."""
        async for _ in self.events(worker, http):
            pass
        if self.n_open:
            raise HTTPException(499, "the client disconnected")
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        verdict = failure(self.results)
        if verdict is not None:
            raise HTTPException(verdict.status, verdict.message)
