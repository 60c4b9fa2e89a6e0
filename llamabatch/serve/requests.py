"""What every route does with the model a request names: hold it (loading it first if need be),
reach its engine, hand it prompts or texts, and let it go once the answer is sent.

Refusals map to one status each, on every route and in every dialect (as_http): a model (or a
file, batch or response) not found 404, a model that is loading, failed to load or has stopped
503, a model busy unloading 409, a full queue 429, a request the engine cannot take 400, a
decode that failed 500, one that outlives --request-timeout 504.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

from fastapi import HTTPException
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from ..engine import BatchEngine, SamplingParams
from ..engine.batch_engine import AdapterBusy
from ..engine.embedding import Pooling
from ..errors import DecodeError, EngineBroken, LlamabatchError
from ..openai_format import Fetch, failure, refusal_status, validation_message
from .metrics import Metrics
from .models import ModelBusy, ModelPool, ModelUnavailable, Served
from .replay import RESUME_EVENTS, RESUME_KEEP_S, Kept, Replays
from .reply import Reply, Translated
from .store import NotFound
from .worker import EngineUnavailable, EngineWorker, PoolingSubmission, QueueFull, Submission, T


class Serving:
    def __init__(self, models: ModelPool, metrics: Metrics, timeout: float, keepalive: float | None = None,
                 replays: Replays | None = None, fetch: Fetch | None = None) -> None:
        """`keepalive`: seconds of silence after which a stream sends an SSE comment (None: never);
        `replays`: the streams that outlive their connection; `fetch`: how images requests name
        by http(s) URL are had (remote_media.fetch; None: such requests are refused)."""
        self.models, self.metrics, self.timeout, self.keepalive = models, metrics, timeout, keepalive
        self.replays = replays or Replays(RESUME_KEEP_S, RESUME_EVENTS)
        self.fetch = fetch

    # -- the model a request names ---------------------------------------------------------

    async def acquire(self, name: str | None) -> Served:
        """The model, loaded and held until release() (a load counts against the request's timeout)."""
        try:
            served = await asyncio.wait_for(self.models.acquire(name), self.timeout)
        except LlamabatchError as e:
            raise as_http(e) from None
        except asyncio.TimeoutError:
            raise HTTPException(504, f"model {name} did not load within {self.timeout:g} s") from None
        try:
            self.engine(served)
        except HTTPException:
            self.models.release(served)
            raise
        return served

    @asynccontextmanager
    async def using(self, name: str | None) -> AsyncIterator[Served]:
        """The model, held until the block ends (a stream it returns holds it on: stream())."""
        served = await self.acquire(name)
        try:
            yield served
        finally:
            self.models.release(served)

    def stream(self, served: Served, chunks: AsyncIterator[str]) -> StreamingResponse:
        """Server-Sent Events, holding the model until the stream ends or its client leaves."""
        self.models.hold(served)
        return _HeldStream(chunks, lambda: self.models.release(served), self.keepalive)

    def detach(self, served: Served, chunks: AsyncIterator[str], stream_id: str) -> Kept:
        """Run a stream to its end whoever listens, its events kept to follow (replay.Replays);
        the model is held until it ends."""
        self.models.hold(served)
        return self.replays.start(chunks, lambda: self.models.release(served), stream_id)

    def follow(self, kept: Kept, after: int = -1) -> StreamingResponse:
        """A kept stream's events after number `after`, as they come; a client that leaves stops
        following, not the stream."""
        return _HeldStream(self.replays.follow(kept, after), lambda: None, self.keepalive, {"X-Stream-Id": kept.id})

    async def on_engine(self, served: Served, action: Callable[[BatchEngine], T]) -> T:
        """Run `action` on the model's engine thread, between steps; its refusals as HTTP errors,
        504 when the engine thread does not come to it within the request timeout (it stopped)."""
        worker = served.worker
        if worker is None:
            raise HTTPException(503, f"model {served.name} is not loaded")
        try:
            with refusals():
                return await asyncio.wait_for(worker.call(action), self.timeout)
        except asyncio.TimeoutError:
            raise HTTPException(504, f"the engine did not take the change within {self.timeout:g} s") from None

    @staticmethod
    def engine(served: Served) -> BatchEngine:
        """The model's engine, or 503 with the reason there is none."""
        worker = served.worker
        if worker is None:
            raise HTTPException(503, f"model {served.name} is not loaded" + (f": {served.error}" if served.error else ""))
        if worker.load_error is not None:
            raise HTTPException(503, f"the model failed to load: {worker.load_error}")
        if worker.refusal is not None:
            raise HTTPException(503, worker.refusal)
        if worker.engine is None:
            raise HTTPException(503, "the model is loading")
        return worker.engine

    # -- its work --------------------------------------------------------------------------

    async def submit(self, served: Served, prompts: list, params: SamplingParams, priority: int = 0,
                     streamed: bool = True) -> Submission:
        """Hand the prompts to the engine and wait until it has taken them (within the request's
        timeout); `streamed`: their tokens are sent as they come (else the answer is whole). 429 when the queue is full for now, 400 when the request can never run (a prompt
        refused, more sequences than any queue takes), 503 when the engine has stopped."""
        worker, failed = served.worker, self.metrics.of(served.name).failed
        engine = self.engine(served)
        submission = Submission(loop=asyncio.get_running_loop(), priority=priority, streamed=streamed)
        try:
            # Text tokenized and the constraint compiled here, on a thread of the pool: the engine
            # thread, which every stream waits on, only queues what it takes (and encodes its
            # images, which would slow its decodes down beside them: Intake.prepare).
            prompts = await asyncio.to_thread(engine.prepare, prompts, params)
            worker.submit(submission, prompts, [params] * len(prompts))
            await asyncio.wait_for(submission.submitted, timeout=max(0.0, submission.t_start + self.timeout - time.perf_counter()))
        except LlamabatchError as e:  # a full queue; TooLarge; a template the model cannot render; a constraint that does not compile
            failed.inc()
            raise as_http(e) from None
        except asyncio.TimeoutError:
            worker.cancel(submission)  # queued behind the take, should it still come
            failed.inc()
            raise HTTPException(504, f"the engine did not take the request within {self.timeout:g} s") from None
        verdict = failure(submission.ended)  # prompts refused at once: empty, too long, a bad constraint
        if verdict is not None:
            worker.cancel(submission)
            failed.inc()
            raise HTTPException(verdict.status, verdict.message)
        return submission

    def reply(self, served: Served, submission: Submission, translated: Translated) -> Reply:
        # The engine that took the submission (not self.engine(): a stop that began since must not refuse it now).
        return Reply(submission, served.worker.engine, translated, self.timeout, self.metrics.of(served.name))

    async def pool(self, served: Served, tokens, pooling: Pooling | None):
        """Texts (or pairs) pooled by the worker beside the running batch: (rows, tokens). 400 for an
        input or model that cannot, 500 when the decode failed, 429, 503 and 504 as for generation."""
        worker: EngineWorker = served.worker
        self.engine(served)
        loop = asyncio.get_running_loop()
        submission = PoolingSubmission(loop, tokens, pooling, loop.create_future())
        try:
            worker.pool(submission)
            return await asyncio.wait_for(submission.done, self.timeout)
        except LlamabatchError as e:
            raise as_http(e) from None
        except asyncio.TimeoutError:
            raise HTTPException(504, f"the embeddings took longer than {self.timeout:g} s") from None


class _HeldStream(StreamingResponse):
    """A stream that lets its model go once the response is over, however it ends: whole, cut by
    the client, or refused before its first chunk (when its chunks never start, their own
    cleanup never runs). With `keepalive`, an SSE comment goes out after each that many seconds
    in which nothing else did: a stream waiting in the queue or behind a long prompt shows
    proxies and clients that it lives (clients skip comments)."""

    def __init__(self, chunks: AsyncIterator[str], release: Callable[[], None], keepalive: float | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(chunks, media_type="text/event-stream", headers=headers)
        self._release, self._keepalive = release, keepalive

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()

    async def stream_response(self, send) -> None:
        if self._keepalive is None:
            return await super().stream_response(send)
        # One timer a stream, and a lock no chunk waits on but while a comment goes out: a
        # chunk costs a timestamp, not a task or a timeout of its own.
        every, lock = self._keepalive, asyncio.Lock()
        last, open_ = time.monotonic(), True

        async def sending(message) -> None:
            nonlocal last, open_
            async with lock:
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    open_ = False  # the last message: nothing may follow it
                await send(message)
                last = time.monotonic()

        async def tick() -> None:
            nonlocal last
            while True:
                await asyncio.sleep(max(0.0, last + every - time.monotonic()))
                async with lock:
                    if not open_:
                        return
                    if time.monotonic() - last >= every:
                        await send({"type": "http.response.body", "body": b": keep-alive\n\n", "more_body": True})
                        last = time.monotonic()

        ticker = asyncio.ensure_future(tick())
        try:
            await super().stream_response(sending)
        finally:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)


# Refusals whose status is not a request's fault (400) or an unknown model (404): by type.
_STATUS = ((QueueFull, 429), (EngineUnavailable, 503), (ModelUnavailable, 503), (ModelBusy, 409), (AdapterBusy, 409), (NotFound, 404),
           (DecodeError, 500), (EngineBroken, 500))


def as_http(error: LlamabatchError | ValidationError) -> HTTPException:
    """A refusal as the HTTP error every route and dialect answers it with (each dialect's app
    handler writes the body in its own shape). A ValidationError is of the chat request another
    dialect's request means (no messages left, say)."""
    if isinstance(error, ValidationError):
        return HTTPException(400, f"the chat request this one means is invalid: {validation_message(error)}")
    status = next((status for kind, status in _STATUS if isinstance(error, kind)), None) or refusal_status(error)
    return HTTPException(status, str(error), headers={"Retry-After": "1"} if status == 429 else None)


@contextmanager
def refusals() -> Iterator[None]:
    """Within the block, a refusal is raised as its HTTP error (as_http)."""
    try:
        yield
    except (LlamabatchError, ValidationError) as e:
        raise as_http(e) from None
