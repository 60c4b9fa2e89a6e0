"""OpenAI's routes: /v1/completions and /v1/chat/completions (whole, or streamed as chunks),
llamabatch's /v1/batch/completions, /v1/embeddings and /v1/rerank. The shapes themselves live
in openai_format and embeddings_format, shared with batch jobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, HTTPException, Request as HttpRequest
from pydantic import Field

from ..chat.conversation import Answer
from ..embeddings_format import EmbeddingRequest, RerankRequest, embedding_tokens, embeddings_body, rerank_body, rerank_tokens
from ..engine import BatchEngine, Ticket, TokenLogprob
from ..engine.embedding import Pooling
from ..openai_format import (
    ChatRequest, CompletionRequest, EngineInputs, NonEmptyStr, SamplingFields, chat_logprobs, check_base_model, choice_index,
    completion_logprobs, engine_inputs, error_body, prompt_logprobs, prompt_progress, request_params, response_body, usage,
)
from .dialects import answer, sse
from .reply import Reply, Translated
from .requests import Serving, refusals
from .worker import EngineWorker


class BatchRequest(SamplingFields):
    """llamabatch's own /v1/batch/completions: many prompts, answered together."""

    prompts: list[NonEmptyStr] = Field(min_length=1)


def openai_routes(serving: Serving, authorized, errors, generation: dict, reasoning_budget: int, pooling: Pooling | None) -> APIRouter:
    """`generation`: the OpenAPI answers of a route that answers JSON or a stream."""
    router = APIRouter(dependencies=[Depends(authorized)])

    @router.post("/v1/completions", responses=generation)
    async def completions(body: CompletionRequest, http: HttpRequest):
        return await _answer(serving, body, "text_completion", http, reasoning_budget, _completion_chunks)

    @router.post("/v1/chat/completions", responses=generation)
    async def chat_completions(body: ChatRequest, http: HttpRequest):
        return await _answer(serving, body, "chat.completion", http, reasoning_budget, _chat_chunks)

    @router.post("/v1/batch/completions", responses=errors(400, 401, 404, 429, 500, 503, 504))
    async def batch_completions(body: BatchRequest, http: HttpRequest) -> dict:
        def translate(engine: BatchEngine) -> Translated:
            return Translated(body, EngineInputs(list(body.prompts), request_params(body, engine)), "batch.completion")

        return await answer(serving, body.model, False, http, translate, _batch_body, None)

    @router.post("/v1/embeddings", responses=errors(400, 401, 404, 429, 500, 503, 504))
    async def embeddings(body: EmbeddingRequest) -> dict:
        async with serving.using(body.model) as served:
            with refusals():
                check_base_model(body.model, serving.engine(served))
            rows, n_tokens = await serving.pool(served, lambda engine: embedding_tokens(engine, body, pooling), pooling)
            with refusals():  # dimensions beyond the model's width
                return embeddings_body(rows, body, served.name, n_tokens)

    @router.post("/v1/rerank", responses=errors(400, 401, 404, 429, 500, 503, 504))
    @router.post("/rerank", include_in_schema=False)
    async def rerank(body: RerankRequest) -> dict:
        async with serving.using(body.model) as served:
            with refusals():
                check_base_model(body.model, serving.engine(served))
            rows, n_tokens = await serving.pool(served, lambda engine: rerank_tokens(engine, body), Pooling.RANK)
            return rerank_body([row[0] for row in rows], body, served.name, n_tokens)

    return router


async def _answer(serving: Serving, body: CompletionRequest | ChatRequest, kind: str, http: HttpRequest, reasoning_budget: int, chunks):
    def translate(engine: BatchEngine) -> Translated:
        return Translated(body, engine_inputs(body, engine, reasoning_budget, serving.fetch), kind, body.shown())

    def whole(reply: Reply) -> dict:
        return response_body(reply.kind, reply.id, reply.created, reply.model, reply.results, reply.vocab, reply.shown, reply.answer)

    return await answer(serving, body.model, body.stream, http, translate, whole, lambda reply, worker: _errors_as_events(chunks(reply, worker)))


def _batch_body(reply: Reply) -> dict:
    results = []
    for result in reply.results:
        results.append({
            "index": result.index, "sample": result.sample, "text": result.text, "finish_reason": result.finish_reason,
            "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens},
            "timings": result.timings and {"queue_s": result.timings.queue_s, "ttft_s": result.timings.ttft_s,
                                           "decode_s": result.timings.decode_s},
        })
    return {"id": reply.id, "object": reply.kind, "created": reply.created, "model": reply.model, "results": results,
            "usage": usage(reply.results), "timings": {"wall_s": time.perf_counter() - reply.submission.t_start}}


async def _completion_chunks(reply: Reply, worker: EngineWorker) -> AsyncIterator[str]:
    by_uid = {ticket.uid: ticket for ticket in reply.submission.tickets}
    started: set[int] = set()
    async for event in reply.events(worker):
        if event.progress is not None:
            yield _chunk(reply, [], prompt_progress=prompt_progress(event.progress))
            continue
        if event.finish_reason is not None:
            reply.raise_if_failed()  # an error event, then [DONE]; the others are cancelled
        ticket = by_uid[event.uid]
        if ticket.uid not in started:  # a choice's first chunk: the prompt, if the request asked for it
            started.add(ticket.uid)
            for chunk in _prompt_chunk(reply, ticket, event.prompt_logprobs or ()):
                yield chunk
        if event.text or event.finish_reason:
            logprobs = completion_logprobs(ticket, [event.logprob] if event.logprob else [], reply.vocab)
            choice = {"index": choice_index(ticket), "text": event.text, "logprobs": logprobs, "finish_reason": event.finish_reason}
            yield _chunk(reply, [choice])
    for chunk in _usage_chunk(reply):
        yield chunk
    yield "data: [DONE]\n\n"


def _prompt_chunk(reply: Reply, ticket: Ticket, scored: tuple[TokenLogprob, ...]) -> list[str]:
    """Echo: the prompt's text (with its log-probabilities when asked: `scored`, its first event's)
    ahead of the completion."""
    shown = reply.shown
    if not shown.echo and shown.prompt_logprobs is None:
        return []
    choice = {"index": choice_index(ticket), "text": ticket.prompt if shown.echo else "", "finish_reason": None,
              "logprobs": completion_logprobs(ticket, [], reply.vocab, scored) if shown.echo else None}
    if shown.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs(scored, reply.vocab, shown.prompt_logprobs)
    return [_chunk(reply, [choice])]


async def _chat_chunks(reply: Reply, worker: EngineWorker) -> AsyncIterator[str]:
    tickets = reply.submission.tickets
    by_uid = {ticket.uid: ticket for ticket in tickets}
    streams = {ticket.uid: reply.answer.stream() for ticket in tickets}  # each choice's reasoning and calls
    for ticket in tickets:
        first = {"index": ticket.sample, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        yield _chunk(reply, [first], object="chat.completion.chunk")
    async for event in reply.events(worker):
        if event.progress is not None:
            yield _chunk(reply, [], object="chat.completion.chunk", prompt_progress=prompt_progress(event.progress))
            continue
        if event.finish_reason is not None:
            reply.raise_if_failed()
        deltas = streams[event.uid].feed(event.text, final=event.finish_reason is not None) if event.text or event.finish_reason else []
        logprobs = chat_logprobs([event.logprob] if event.logprob else [], by_uid[event.uid], reply.vocab)
        finish = Answer.finish_reason(event.finish_reason, streams[event.uid].called)
        if event.finish_reason and not deltas:
            deltas = [{}]
        for i, delta in enumerate(deltas):  # logprobs ride on the first, the finish reason on the last
            last = i == len(deltas) - 1
            choice = {"index": event.sample, "delta": delta, "logprobs": logprobs if i == 0 else None,
                      "finish_reason": finish if last else None}
            yield _chunk(reply, [choice], object="chat.completion.chunk")
    for chunk in _usage_chunk(reply, object="chat.completion.chunk"):
        yield chunk
    yield "data: [DONE]\n\n"


def _object(reply: Reply, choices: list, **extra) -> dict:
    return {"id": reply.id, "object": reply.kind, "created": reply.created, "model": reply.model, "choices": choices, **extra}


def _chunk(reply: Reply, choices: list, **extra) -> str:
    usage_field = {"usage": None} if reply.shown.usage_chunk else {}  # OpenAI: null on every chunk but the last
    return sse(_object(reply, choices, **usage_field, **extra))


def _usage_chunk(reply: Reply, **extra) -> list[str]:
    """With stream_options.include_usage: a last chunk, no choices, the whole request's usage."""
    return [sse(_object(reply, [], usage=usage(reply.results), **extra))] if reply.shown.usage_chunk else []


async def _errors_as_events(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once a stream has started its status is sent: a failure (a failed sequence, a timeout)
    becomes an error event with the status the whole answer would have had, then [DONE]."""
    try:
        async for chunk in chunks:
            yield chunk
    except HTTPException as e:
        yield sse(error_body(e.status_code, str(e.detail)))
        yield "data: [DONE]\n\n"
