"""Streams that outlive their connection: a request that asks to (Responses' `background`, the
X-Background header elsewhere) runs on its own task, its events numbered and kept, so a client
that dropped reattaches from the event after the last it read, and one that never listened asks
how it went. A kept stream stays for --resume-keep seconds after it ends; at most --resume-events
of its latest events are kept (a client further behind is told it is too late), and at most
MAX_STREAMS streams, the oldest ended ones going first."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import HTTPException

from ..openai_format import error_body

log = logging.getLogger(__name__)
MAX_STREAMS = 1024  # kept at once (running ones are never dropped)
RESUME_KEEP_S = 300.0  # --resume-keep's default
RESUME_EVENTS = 4096  # --resume-events'



@dataclass(eq=False)
class Kept:
    """One detached stream's SSE events (numbered from 0), as its producer made them."""

    id: str
    events: list[str] = field(default_factory=list)  # its latest ones; the first is number `first`
    first: int = 0
    ended: float | None = None  # when its producer finished (time.monotonic)
    cancelled: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set, and replaced, at each change
    task: asyncio.Task | None = None

    @property
    def count(self) -> int:
        return self.first + len(self.events)

    def wake(self) -> None:
        """Followers waiting for more go on. Each waits on the event it took before it last looked,
        so one follower never hides a change from another (a shared event cleared by one would)."""
        woken, self.changed = self.changed, asyncio.Event()
        woken.set()


class Replays:
    """The kept streams of one server, by id."""

    def __init__(self, keep_s: float, max_events: int) -> None:
        self.keep_s, self.max_events = keep_s, max_events
        self._streams: dict[str, Kept] = {}

    def start(self, events: AsyncIterator[str], done: Callable[[], None], stream_id: str | None = None) -> Kept:
        """Run `events` to their end on a task of their own, whoever listens; `done` once they end."""
        self._expire()
        kept = Kept(stream_id or f"stream_{secrets.token_hex(12)}")
        self._streams[kept.id] = kept
        kept.task = asyncio.ensure_future(self._produce(kept, events, done))
        return kept

    def get(self, stream_id: str) -> Kept:
        self._expire()
        kept = self._streams.get(stream_id)
        if kept is None:
            raise HTTPException(404, f"no stream with id {stream_id!r} is kept here (it never was, or ended more than {self.keep_s:g} s ago)")
        return kept

    def find(self, stream_id: str) -> Kept | None:
        self._expire()
        return self._streams.get(stream_id)

    async def cancel(self, kept: Kept) -> None:
        """Stop its producer (which cancels its sequences in the engine), and wait until it has."""
        if kept.ended is None and kept.task is not None:
            kept.cancelled = True
            kept.task.cancel()
            await asyncio.wait([kept.task])

    @staticmethod
    def last_read(starting_after: int | None, last_event_id: int | None) -> int:
        """The event a client read last: ?starting_after=N, else its Last-Event-ID header, else none (-1)."""
        if starting_after is not None:
            return starting_after
        return -1 if last_event_id is None else last_event_id

    def follow(self, kept: Kept, after: int = -1) -> AsyncIterator[str]:
        """Its events numbered after `after`, then each new one as it comes, until it ends; each
        with its number as the SSE id (what a client's Last-Event-ID sends back). A client that
        leaves stops following; the stream goes on. 410 when those events are no longer kept."""
        if after + 1 < kept.first:
            raise HTTPException(410, f"events before {kept.first} of stream {kept.id} are no longer kept (asked from {after + 1})")
        return self._events(kept, after + 1)

    @staticmethod
    async def _events(kept: Kept, at: int) -> AsyncIterator[str]:
        while True:
            changed = kept.changed  # taken before looking: whatever comes after sets it
            while at < kept.count:
                if at < kept.first:  # dropped while this client was slow to read
                    yield _sse_error(410, f"events before {kept.first} of stream {kept.id} are no longer kept")
                    return
                yield f"id: {at}\n{kept.events[at - kept.first]}"
                at += 1
            if kept.ended is not None:
                return
            await changed.wait()

    async def _produce(self, kept: Kept, events: AsyncIterator[str], done: Callable[[], None]) -> None:
        try:  # (a cancel ends it at its next await: the events' own cleanup cancels their sequences)
            async for event in events:
                self._add(kept, event)
        except Exception as e:  # noqa: BLE001 - the stream's own failure: its followers are told, the server goes on
            log.exception("stream %s failed", kept.id)
            self._add(kept, _sse_error(500, f"the stream failed: {type(e).__name__}: {e}"))
        finally:
            kept.ended = time.monotonic()
            kept.wake()
            done()

    def _add(self, kept: Kept, event: str) -> None:
        kept.events.append(event)
        if len(kept.events) > self.max_events:
            del kept.events[0]
            kept.first += 1
        kept.wake()

    def _expire(self) -> None:
        now = time.monotonic()
        for stream_id, kept in list(self._streams.items()):
            if kept.ended is not None and now - kept.ended > self.keep_s:
                del self._streams[stream_id]
        ended = sorted((k for k in self._streams.values() if k.ended is not None), key=lambda k: k.ended or 0.0)
        for kept in ended[:max(0, len(self._streams) - MAX_STREAMS)]:
            del self._streams[kept.id]


def _sse_error(status: int, message: str) -> str:
    return f"data: {json.dumps(error_body(status, message))}\n\n"
