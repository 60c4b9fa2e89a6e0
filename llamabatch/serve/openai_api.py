"""One request's events turned into OpenAI responses, whole or as Server-Sent Event chunks
(the shapes themselves live in openai_format, shared with batch jobs)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import HTTPException, Request as HttpRequest
from pydantic import Field

from ..chat.conversation import Answer
from ..engine import BatchEngine, Event
from ..openai_format import NonEmptyStr, SamplingFields, Shown, chat_logprobs, choice_index, completion_logprobs, error_body, failure, new_id, prompt_logprobs, response_body, usage
from .metrics import Metrics
from .worker import EngineWorker, Submission


class BatchRequest(SamplingFields):
    """llamabatch's own /v1/batch/completions: many prompts, answered together."""

    prompts: list[NonEmptyStr] = Field(min_length=1)


class Reply:
    """Turns one request's events into OpenAI responses: whole, or as a stream of chunks."""

    def __init__(
        self, submission: Submission, engine: BatchEngine, kind: str, timeout: float, metrics: Metrics, shown: Shown = Shown(),
        model: str | None = None, answer: Answer | None = None,
    ) -> None:
        # the model the request named (an adapter's name answers as that adapter, as vLLM does)
        self.submission, self.model, self.kind, self.timeout, self.metrics = submission, model or engine.model_name, kind, timeout, metrics
        self.shown, self.answer = shown, answer or Answer()
        self.vocab = engine.vocab  # pieces are cached and read-only: safe beside the engine thread
        self.id = new_id(kind)
        self.created = int(time.time())
        self.n_open = submission.n_open  # counted by the engine thread: those that finish by now still send their events
        self._by_uid = {seq.uid: seq for seq in submission.sequences}

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
                    self.n_open -= event.finish_reason is not None
                    yield event
        finally:
            if self.n_open:
                worker.cancel(self.submission)
                self.metrics.failed.inc()
            else:
                self.metrics.finished.inc()

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

    def _object(self, choices: list, **extra) -> dict:
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model, "choices": choices, **extra}

    async def drain(self, worker: EngineWorker, http: HttpRequest) -> None:
        """Wait for every sequence to finish; an HTTPException when the request failed."""
        async for _ in self.events(worker, http):
            pass
        if self.n_open:
            raise HTTPException(499, "the client disconnected")
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        verdict = failure(self.submission.sequences)
        if verdict is not None:
            raise HTTPException(verdict.status, verdict.message)

    async def whole(self, worker: EngineWorker, http: HttpRequest) -> dict:
        """The completion or chat.completion object, once every sequence has finished."""
        await self.drain(worker, http)
        return response_body(self.kind, self.id, self.created, self.model, self.submission.sequences, self.vocab, self.shown, self.answer)

    async def batch(self, worker: EngineWorker, http: HttpRequest) -> dict:
        await self.drain(worker, http)
        results = []
        for seq in self.submission.sequences:
            result = seq.result()
            results.append({
                "index": result.index, "sample": result.sample, "text": result.text, "finish_reason": result.finish_reason,
                "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens},
                "timings": result.timings and {"queue_s": result.timings.queue_s, "ttft_s": result.timings.ttft_s,
                                               "decode_s": result.timings.decode_s},
            })
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model, "results": results,
                "usage": usage(self.submission.sequences), "timings": {"wall_s": time.perf_counter() - self.submission.t_start}}

    async def completion_chunks(self, worker: EngineWorker) -> AsyncIterator[str]:
        async for chunk in _errors_as_events(self._completion_chunks(worker)):
            yield chunk

    async def chat_chunks(self, worker: EngineWorker) -> AsyncIterator[str]:
        async for chunk in _errors_as_events(self._chat_chunks(worker)):
            yield chunk

    async def _completion_chunks(self, worker: EngineWorker) -> AsyncIterator[str]:
        started: set[int] = set()
        async for event in self.events(worker):
            if event.finish_reason is not None:
                self.raise_if_failed()  # an error event, then [DONE]; the others are cancelled
            seq = self._by_uid[event.uid]
            if seq.uid not in started:  # a choice's first chunk: the prompt, if the request asked for it
                started.add(seq.uid)
                for chunk in self._prompt_chunk(seq):
                    yield chunk
            if event.text or event.finish_reason:
                logprobs = completion_logprobs(seq, [event.logprob] if event.logprob else [], self.vocab)
                choice = {"index": choice_index(seq), "text": event.text, "logprobs": logprobs,
                          "finish_reason": event.finish_reason}
                yield self._chunk([choice])
        for chunk in self._usage_chunk():
            yield chunk
        yield "data: [DONE]\n\n"

    def _prompt_chunk(self, seq) -> list[str]:
        """Echo: the prompt's text (with its log-probabilities when asked) ahead of the completion."""
        if not self.shown.echo and self.shown.prompt_logprobs is None:
            return []
        choice = {"index": choice_index(seq), "text": seq.prompt if self.shown.echo else "", "finish_reason": None,
                  "logprobs": completion_logprobs(seq, [], self.vocab, echo=True) if self.shown.echo else None}
        if self.shown.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(seq, self.vocab, self.shown.prompt_logprobs)
        return [self._chunk([choice])]

    async def _chat_chunks(self, worker: EngineWorker) -> AsyncIterator[str]:
        streams = {seq.uid: self.answer.stream() for seq in self.submission.sequences}  # each choice's reasoning and calls
        for seq in self.submission.sequences:
            first = {"index": seq.sample, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            yield self._chunk([first], object="chat.completion.chunk")
        async for event in self.events(worker):
            if event.finish_reason is not None:
                self.raise_if_failed()
            deltas = streams[event.uid].feed(event.text, final=event.finish_reason is not None) if event.text or event.finish_reason else []
            logprobs = chat_logprobs([event.logprob] if event.logprob else [], self._by_uid[event.uid], self.vocab)
            finish = Answer.finish_reason(event.finish_reason, streams[event.uid].called)
            if event.finish_reason and not deltas:
                deltas = [{}]
            for i, delta in enumerate(deltas):  # logprobs ride on the first, the finish reason on the last
                last = i == len(deltas) - 1
                choice = {"index": event.sample, "delta": delta, "logprobs": logprobs if i == 0 else None,
                          "finish_reason": finish if last else None}
                yield self._chunk([choice], object="chat.completion.chunk")
        for chunk in self._usage_chunk(object="chat.completion.chunk"):
            yield chunk
        yield "data: [DONE]\n\n"

    def _chunk(self, choices: list, **extra) -> str:
        usage_field = {"usage": None} if self.shown.usage_chunk else {}  # OpenAI: null on every chunk but the last
        return _sse(self._object(choices, **usage_field, **extra))

    def _usage_chunk(self, **extra) -> list[str]:
        """With stream_options.include_usage: a last chunk, no choices, the whole request's usage."""
        return [_sse(self._object([], usage=usage(self.submission.sequences), **extra))] if self.shown.usage_chunk else []


async def _errors_as_events(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once a stream has started its status is sent: a failure (a failed sequence, a timeout)
    becomes an error event with the status the whole answer would have had, then [DONE]."""
    try:
        async for chunk in chunks:
            yield chunk
    except HTTPException as e:
        yield _sse(error_body(e.status_code, str(e.detail)))
        yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
