"""OpenAI's API shapes: request bodies (pydantic), and one request's events turned into
responses, whole or as Server-Sent Event chunks."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator

from fastapi import HTTPException, Request as HttpRequest
from pydantic import BaseModel, Field

from .engine import BatchEngine
from .metrics import Metrics
from .results import Event
from .sampling import SamplingParams
from .worker import EngineWorker, Request

class SamplingFields(BaseModel):
    """OpenAI's sampling fields (their defaults), plus llama.cpp's top_k and min_p."""

    model: str | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    ignore_eos: bool = False

    def params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        fields = self.model_dump(exclude={"model", "stop"} | set(self._extra_fields()))
        return SamplingParams(**fields, stop=tuple(stop), logprobs=self.logprob_count())

    def logprob_count(self) -> int | None:
        return None

    def _extra_fields(self) -> set[str]:
        return set(type(self).model_fields) - set(SamplingFields.model_fields)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool = False
    logprobs: int | None = None  # the sampled token's log-probability and this many alternatives

    def logprob_count(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class BatchRequest(SamplingFields):
    prompts: list[str] = Field(min_length=1)


class Reply:
    """Turns one request's events into OpenAI responses: whole, or as a stream of chunks."""

    def __init__(self, job: Request, engine: BatchEngine, kind: str, timeout: float, metrics: Metrics) -> None:
        self.job, self.model, self.kind, self.timeout, self.metrics = job, engine.model_name, kind, timeout, metrics
        self.vocab = engine.vocab  # pieces are cached and read-only: safe beside the engine thread
        self.id = f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.n_open = len(job.sequences)
        self._by_uid = {seq.uid: seq for seq in job.sequences}

    def choice_index(self, seq_or_event) -> int:
        n = self.job.sequences[0].params.n
        return seq_or_event.index * n + seq_or_event.sample

    async def events(self, worker: EngineWorker, http: HttpRequest | None = None) -> AsyncIterator[Event]:
        """This request's events until every sequence has finished; cancels them if the client
        leaves, the request times out, or the consumer stops early."""
        deadline = self.job.t_start + self.timeout
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
                    event = await asyncio.wait_for(self.job.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    continue
                self.n_open -= event.finish_reason is not None
                yield event
        finally:
            if self.n_open:
                worker.cancel(self.job)
                self.metrics.failed.inc()
            else:
                self.metrics.finished.inc()

    def _sequence(self, event: Event):
        return self._by_uid[event.uid]

    def _completion_logprobs(self, logprobs: list, seq) -> dict | None:
        """OpenAI's legacy completions format: parallel lists per token."""
        if seq.params.logprobs is None:
            return None
        vocab = self.vocab
        return {
            "tokens": [_piece(vocab, lp.token) for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{_piece(vocab, t): v for t, v in lp.top} for lp in logprobs],
        }

    def _chat_logprobs(self, logprobs: list, seq) -> dict | None:
        """OpenAI's chat format: one entry per token, with its alternatives."""
        if seq.params.logprobs is None:
            return None

        def entry(token: int, logprob: float) -> dict:
            return {"token": _piece(self.vocab, token), "logprob": logprob, "bytes": list(self.vocab.piece(token))}

        return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]}

    def usage(self) -> dict:
        prompt = sum(s.n_prompt for s in self.job.sequences if s.sample == 0)
        completion = sum(s.n_generated for s in self.job.sequences)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _object(self, choices: list, **extra) -> dict:
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model, "choices": choices, **extra}

    async def _drain(self, worker: EngineWorker, http: HttpRequest) -> None:
        async for _ in self.events(worker, http):
            pass
        if self.n_open:
            raise HTTPException(499, "the client disconnected")

    async def completion(self, worker: EngineWorker, http: HttpRequest) -> dict:
        await self._drain(worker, http)
        choices = [
            {"index": self.choice_index(s), "text": s.text.text, "logprobs": self._completion_logprobs(s.logprobs, s),
             "finish_reason": s.finish_reason}
            for s in self.job.sequences
        ]
        return self._object(sorted(choices, key=lambda c: c["index"]), usage=self.usage())

    async def chat(self, worker: EngineWorker, http: HttpRequest) -> dict:
        await self._drain(worker, http)
        choices = [
            {"index": s.sample, "message": {"role": "assistant", "content": s.text.text},
             "logprobs": self._chat_logprobs(s.logprobs, s), "finish_reason": s.finish_reason}
            for s in self.job.sequences
        ]
        return self._object(choices, usage=self.usage())

    async def batch(self, worker: EngineWorker, http: HttpRequest) -> dict:
        await self._drain(worker, http)
        results = []
        for seq in self.job.sequences:
            result = seq.result()
            results.append({
                "index": result.index, "sample": result.sample, "text": result.text, "finish_reason": result.finish_reason,
                "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens},
                "timings": result.timings and {"queue_s": result.timings.queue_s, "ttft_s": result.timings.ttft_s,
                                               "decode_s": result.timings.decode_s},
            })
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model, "results": results,
                "usage": self.usage(), "timings": {"wall_s": time.perf_counter() - self.job.t_start}}

    async def completion_chunks(self, worker: EngineWorker) -> AsyncIterator[str]:
        async for chunk in _errors_as_events(self._completion_chunks(worker)):
            yield chunk

    async def chat_chunks(self, worker: EngineWorker) -> AsyncIterator[str]:
        async for chunk in _errors_as_events(self._chat_chunks(worker)):
            yield chunk

    async def _completion_chunks(self, worker: EngineWorker) -> AsyncIterator[str]:
        async for event in self.events(worker):
            if event.text or event.finish_reason:
                seq = self._sequence(event)
                logprobs = [event.logprob] if event.logprob else []
                choice = {"index": self.choice_index(event), "text": event.text,
                          "logprobs": self._completion_logprobs(logprobs, seq), "finish_reason": _reason(event)}
                yield _sse(self._object([choice]))
        yield _sse(self._object([], usage=self.usage()))
        yield "data: [DONE]\n\n"

    async def _chat_chunks(self, worker: EngineWorker) -> AsyncIterator[str]:
        for seq in self.job.sequences:
            yield _sse(self._object([{"index": seq.sample, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                                    object="chat.completion.chunk"))
        async for event in self.events(worker):
            if event.text or event.finish_reason:
                delta = {"content": event.text} if event.text else {}
                logprobs = self._chat_logprobs([event.logprob] if event.logprob else [], self._sequence(event))
                choice = {"index": event.sample, "delta": delta, "logprobs": logprobs, "finish_reason": _reason(event)}
                yield _sse(self._object([choice], object="chat.completion.chunk"))
        yield _sse(self._object([], object="chat.completion.chunk", usage=self.usage()))
        yield "data: [DONE]\n\n"


async def _errors_as_events(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once a stream has started its status is sent: an error (a timeout) becomes an error event."""
    try:
        async for chunk in chunks:
            yield chunk
    except HTTPException as e:
        yield _sse({"error": {"message": str(e.detail), "type": "server_error", "param": None, "code": e.status_code}})


def _piece(vocab, token: int) -> str:
    return vocab.piece(token).decode(errors="replace")


def _reason(event: Event) -> str | None:
    return event.finish_reason if event.finish_reason in (None, "stop", "length") else "stop"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
