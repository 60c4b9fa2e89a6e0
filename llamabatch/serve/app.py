"""`llamabatch serve`: an OpenAI-compatible HTTP server whose requests share one running batch.

Every request becomes one or more sequences in the engine worker's queue; they join the
batch at its next step and leave when done (continuous batching). Streams are Server-Sent
Events in OpenAI's chunk format. A client that goes away has its sequences cancelled.
"""

from __future__ import annotations

import asyncio
import secrets
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, HTTPException, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine import BatchEngine, SamplingParams
from ..errors import LlamabatchError
from ..openai_format import (
    ChatRequest, CompletionRequest, SamplingFields, engine_inputs, error_body, validation_message,
)
from .metrics import Metrics
from .openai_api import BatchRequest, Reply
from .worker import EngineWorker, QueueFull, Request


@dataclass(frozen=True)
class ServerSettings:
    engine: dict  # BatchEngine keyword arguments (model, n_parallel, n_ctx, ...)
    api_key: str | None = None
    max_queue: int = 256  # sequences waiting for a slot before requests get 429
    request_timeout: float = 600.0  # seconds until a request is cancelled and answered 504

# -- the app -----------------------------------------------------------------------------


def create_app(settings: ServerSettings) -> FastAPI:
    metrics = Metrics()
    worker = EngineWorker(lambda: BatchEngine(**settings.engine), settings.max_queue, metrics.observer())
    metrics.watch(worker)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()  # loads the model in its thread: /health says 503 until then
        yield
        worker.stop()

    app = FastAPI(title="llamabatch", lifespan=lifespan)
    authorized = _authorization(settings.api_key)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return _error(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        return _error(400, validation_message(exc.errors()))

    @app.get("/health")
    async def health():
        if worker.load_error is not None:
            return _error(503, f"the model failed to load: {worker.load_error}", kind="server_error")
        if not worker.ready.is_set() or worker.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        engine = _engine(worker)
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0, "owned_by": "llamabatch"}]}

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, http: HttpRequest):
        return await answer(body, "text_completion", http)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatRequest, http: HttpRequest):
        return await answer(body, "chat.completion", http)

    async def answer(body: CompletionRequest | ChatRequest, kind: str, http: HttpRequest):
        engine = _engine(worker)
        try:
            prompts, params = engine_inputs(body, engine)
        except LlamabatchError as e:
            raise HTTPException(400, str(e)) from None
        job = await _submit(worker, prompts, params, metrics)
        reply = Reply(job, engine, kind, settings.request_timeout, metrics)
        if body.stream:
            chunks = reply.chat_chunks(worker) if kind == "chat.completion" else reply.completion_chunks(worker)
            return StreamingResponse(chunks, media_type="text/event-stream")
        return await reply.whole(worker, http)

    @app.post("/v1/batch/completions", dependencies=[Depends(authorized)])
    async def batch_completions(body: BatchRequest, http: HttpRequest):
        job = await _submit(worker, body.prompts, _params(body), metrics)
        reply = Reply(job, _engine(worker), "batch.completion", settings.request_timeout, metrics)
        return await reply.batch(worker, http)

    return app


def _authorization(api_key: str | None):
    async def check(http: HttpRequest) -> None:
        if api_key is None:
            return
        given = http.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise HTTPException(401, "missing or wrong API key (Authorization: Bearer KEY)")

    return check


def _engine(worker: EngineWorker) -> BatchEngine:
    if worker.engine is None:
        raise HTTPException(503, "the model is still loading")
    return worker.engine


def _params(body: SamplingFields) -> SamplingParams:
    try:
        return body.params()
    except LlamabatchError as e:
        raise HTTPException(400, str(e)) from None


async def _submit(worker: EngineWorker, prompts: list, params: SamplingParams, metrics: Metrics) -> Request:
    """Hand the prompts to the engine; 429 when the queue is full, 400 when a prompt cannot run."""
    _engine(worker)
    job = Request(loop=asyncio.get_running_loop())
    try:
        worker.submit(job, prompts, [params] * len(prompts))
    except QueueFull as e:
        metrics.failed.inc()
        raise HTTPException(429, str(e), headers={"Retry-After": "1"}) from None
    await job.submitted
    rejected = [seq for seq in job.sequences if seq.finish_reason == "error"]
    if rejected:
        worker.cancel(job)
        metrics.failed.inc()
        raise HTTPException(400, f"prompt {rejected[0].index}: {rejected[0].error}")
    return job


def _error(status: int, message: str, kind: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind), status_code=status, headers=headers)
