"""What every dialect (OpenAI's completions and chat, Anthropic's Messages, OpenAI's Responses)
does with a request: translate it into the engine's inputs, submit them, and answer whole or as
a stream; the one SSE writer, and the blocks the typed-event streams are made of."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import HTTPException, Request as HttpRequest

from ..engine import BatchEngine
from .reply import Reply, Translated
from .requests import Serving, refusals
from .worker import EngineWorker


async def answer(
    serving: Serving, model: str | None, stream: bool, http: HttpRequest, translate: Callable[[BatchEngine], Translated],
    whole: Callable[[Reply], Awaitable[dict] | dict | list], events: Callable[[Reply, EngineWorker], AsyncIterator[str]],
    background: str | None = None,
):
    """Hold the model, translate the request on a thread of its own (a template rendered and
    tokenized there, not on the event loop the streams share), submit it, and answer: `whole`
    once every sequence has finished, or a stream of `events`. Refusals are HTTP errors (as_http).

    A request that outlives its connection (the X-Background header; Responses' `background`,
    which names its id in `background`) runs its events on a task of their own, kept under that
    id to be followed (replay.Replays): a streamed one is answered by following them; for one
    not streamed, the Kept is returned for its dialect to answer."""
    if background is None and _asks_background(http):
        if not stream:
            raise HTTPException(400, "X-Background keeps a stream to come back to: add \"stream\": true")
        background = ""
    async with serving.using(model) as served:
        translated = await asyncio.to_thread(_translate, translate, serving.engine(served))
        request = translated.request
        # A background request's events are kept to be followed (streamed later, or now): they are read.
        streamed = stream or background is not None
        submission = await serving.submit(served, translated.inputs.prompts, translated.inputs.params, request.priority, streamed=streamed)
        reply = serving.reply(served, submission, translated)
        if background is not None:
            kept = serving.detach(served, events(reply, served.worker), background or reply.id)
            return serving.follow(kept) if stream else kept
        if stream:
            return serving.stream(served, events(reply, served.worker))
        await reply.drain(served.worker, http)
        body = whole(reply)
        return await body if asyncio.iscoroutine(body) else body


def _asks_background(http: HttpRequest) -> bool:
    return http.headers.get("x-background", "").lower() in ("1", "true", "yes")


def _translate(translate: Callable[[BatchEngine], Translated], engine: BatchEngine) -> Translated:
    with refusals():
        return translate(engine)


def sse(data: dict, event: str | None = None) -> str:
    """One Server-Sent Event: a typed one (Anthropic's, the Responses API's), or OpenAI's data line."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


class Blocks:
    """An answer's stream deltas (reasoning_content, content, tool_calls: Answer.stream's) as
    blocks, one open at a time: a delta of another kind closes the open one and opens its own,
    and each tool call is a block of its own. A dialect says what opening, adding to and
    closing a block send (opened, added, closed, called)."""

    def __init__(self) -> None:
        self.kind: str | None = None  # the open block's: "reasoning", "text" or "tool_call"

    def feed(self, delta: dict) -> list[str]:
        out = []
        if delta.get("reasoning_content"):
            out += self._open("reasoning") + self.added("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self._open("text") + self.added("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            out += self.close() + self.called(call)
        return out

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        kind, self.kind = self.kind, None
        return self.closed(kind)

    def _open(self, kind: str) -> list[str]:
        if self.kind == kind:
            return []
        out = self.close()
        self.kind = kind
        return out + self.opened(kind)

    def opened(self, kind: str) -> list[str]:
        raise NotImplementedError

    def added(self, kind: str, text: str) -> list[str]:
        raise NotImplementedError

    def closed(self, kind: str) -> list[str]:
        raise NotImplementedError

    def called(self, call: dict) -> list[str]:
        """A tool call's events; it may leave its block open (self.kind = "tool_call")."""
        raise NotImplementedError
