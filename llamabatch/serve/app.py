"""`llamabatch serve`: an OpenAI-compatible HTTP server whose requests share one running batch.

Every request becomes one or more sequences in the engine worker's queue; they join the
batch at its next step and leave when done (continuous batching). Streams are Server-Sent
Events in OpenAI's chunk format. A client that goes away has its sequences cancelled.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from importlib.metadata import version

from fastapi import Depends, FastAPI, HTTPException, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import BatchEngine, SamplingParams
from ..embeddings_format import (
    EmbeddingRequest, RerankRequest, embedding_tokens, embeddings_body, rerank_body, rerank_tokens,
)
from ..engine.embedding import Pooling
from ..errors import DecodeError, EngineBroken, LlamabatchError
from ..openai_format import (
    ChatRequest, CompletionRequest, check_base_model, engine_inputs, error_body, failure, refusal_status,
    request_params, validation_message,
)
from .anthropic_api import anthropic_routes, error_body as anthropic_error_body
from .batch_api import batch_routes, resume_batches
from .metrics import Metrics
from .store import Store
from .openai_api import BatchRequest, Reply
from .responses_api import responses_routes
from .tokenizer_api import tokenizer_routes
from .worker import EngineUnavailable, EngineWorker, PoolingSubmission, QueueFull, Submission


@dataclass(frozen=True)
class ServerSettings:
    engine: dict  # BatchEngine keyword arguments (model, n_parallel, n_ctx, ...)
    api_key: str | None = None
    max_queue: int = 256  # sequences (and embedding requests) waiting before requests get 429
    request_timeout: float = 600.0  # seconds until a request is cancelled and answered 504
    pooling: Pooling | None = None  # /v1/embeddings: the GGUF's pooling, else mean, unless set
    data_dir: Path | None = None  # files and batches (OpenAI's Batch API); None: no batch API
    max_upload: int = 200 << 20  # bytes a file upload may have (413 beyond)
    reasoning_budget: int = -1  # a chat request's thought in tokens at most, unless it says (-1: no limit, 0: no thinking)

# -- the app -----------------------------------------------------------------------------


def create_app(settings: ServerSettings) -> FastAPI:
    metrics = Metrics()
    worker = EngineWorker(lambda: BatchEngine(**settings.engine), settings.max_queue, metrics.observer())
    metrics.watch(worker)

    store = Store(settings.data_dir) if settings.data_dir is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()  # loads the model in its thread: /health says 503 until then
        if store is not None:  # batches a stopped server left unfinished resume once the model is in
            asyncio.get_running_loop().run_in_executor(None, _resume_when_loaded, store, worker)
        yield
        worker.stop()
        if store is not None:
            store.close()

    app = FastAPI(title="llamabatch", version=version("llamabatch"), lifespan=lifespan)
    app.state.worker = worker  # a Ray Serve replica starts and stops it itself (no lifespan there)
    authorized = _authorization(settings.api_key)
    app.openapi = lambda: _openapi(app, worker)

    @app.exception_handler(StarletteHTTPException)  # FastAPI's own too: a body that is not JSON, say
    async def http_error(request, exc: StarletteHTTPException):
        headers = exc.headers
        if exc.status_code == 405:  # Starlette names the first route's methods only: name every route's on the path
            allowed = {m for route in app.routes if isinstance(route, APIRoute) and route.path_regex.match(request.url.path)
                       for m in route.methods}
            headers = {**(headers or {}), "Allow": ", ".join(sorted(allowed))}
        return _error(exc.status_code, str(exc.detail), headers=headers, anthropic=_is_anthropic(request))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        return _error(400, validation_message(exc.errors()), anthropic=_is_anthropic(request))

    @app.get("/health", responses=_errors(503))
    async def health() -> dict:
        try:
            _engine(worker)
        except HTTPException as e:
            return _error(e.status_code, str(e.detail))
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {"content": {"text/plain": {}}}})
    async def metrics_text():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models", dependencies=[Depends(authorized)], responses=_errors(401, 503))
    async def models() -> dict:
        engine = _engine(worker)
        card = {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "llamabatch",
                "max_model_len": engine.ctx.n_ctx_seq}
        # vLLM's way: each adapter is a model of its own, its parent the base model
        adapters = [{**card, "id": a.name, "parent": engine.model_name, "root": str(a.path)} for a in engine.adapters.info]
        return {"object": "list", "data": [card, *adapters]}

    @app.get("/lora-adapters", dependencies=[Depends(authorized)], responses=_errors(401, 503))
    async def lora_adapters() -> list[dict]:
        """llama-server's listing: the ids a request's `lora` field names, with the default scales."""
        engine = _engine(worker)
        default = dict(engine.adapters.default)
        return [{"id": a.id, "name": a.name, "path": str(a.path), "scale": default.get(a.id, 0.0)} for a in engine.adapters.info]

    @app.post("/v1/completions", dependencies=[Depends(authorized)], responses=_GENERATION)
    async def completions(body: CompletionRequest, http: HttpRequest):
        return await answer(body, "text_completion", http)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)], responses=_GENERATION)
    async def chat_completions(body: ChatRequest, http: HttpRequest):
        return await answer(body, "chat.completion", http)

    async def answer(body: CompletionRequest | ChatRequest, kind: str, http: HttpRequest):
        engine = _engine(worker)
        try:  # a chat template rendered, and tokenized, on a thread of its own: the event loop serves the streams
            inputs = await asyncio.to_thread(engine_inputs, body, engine, settings.reasoning_budget)
        except LlamabatchError as e:
            raise HTTPException(refusal_status(e), str(e)) from None
        submission = await _submit(worker, inputs.prompts, inputs.params, metrics, settings.request_timeout, body.priority)
        reply = Reply(submission, engine, kind, settings.request_timeout, metrics, body.shown(), body.model, inputs.answer)
        if body.stream:
            chunks = reply.chat_chunks(worker) if kind == "chat.completion" else reply.completion_chunks(worker)
            return StreamingResponse(chunks, media_type="text/event-stream")
        return await reply.whole(worker, http)

    @app.post("/v1/batch/completions", dependencies=[Depends(authorized)], responses=_errors(400, 401, 404, 429, 500, 503, 504))
    async def batch_completions(body: BatchRequest, http: HttpRequest) -> dict:
        try:
            params = request_params(body, _engine(worker))
        except LlamabatchError as e:
            raise HTTPException(refusal_status(e), str(e)) from None
        submission = await _submit(worker, body.prompts, params, metrics, settings.request_timeout, body.priority)
        reply = Reply(submission, _engine(worker), "batch.completion", settings.request_timeout, metrics, model=body.model)
        return await reply.batch(worker, http)

    @app.post("/v1/embeddings", dependencies=[Depends(authorized)], responses=_errors(400, 401, 404, 429, 500, 503, 504))
    async def embeddings(body: EmbeddingRequest) -> dict:
        _served(body.model, worker)
        pooling = settings.pooling
        rows, n_tokens = await _pool(worker, lambda engine: embedding_tokens(engine, body, pooling), pooling, settings.request_timeout)
        try:
            return embeddings_body(rows, body, _engine(worker).model_name, n_tokens)
        except LlamabatchError as e:  # dimensions beyond the model's width
            raise HTTPException(400, str(e)) from None

    @app.post("/v1/rerank", dependencies=[Depends(authorized)], responses=_errors(400, 401, 404, 429, 500, 503, 504))
    @app.post("/rerank", dependencies=[Depends(authorized)], include_in_schema=False)
    async def rerank(body: RerankRequest) -> dict:
        _served(body.model, worker)
        rows, n_tokens = await _pool(worker, lambda engine: rerank_tokens(engine, body), Pooling.RANK, settings.request_timeout)
        return rerank_body([row[0] for row in rows], body, _engine(worker).model_name, n_tokens)

    app.include_router(tokenizer_routes(lambda: _engine(worker), authorized, _errors))

    async def submit(prompts: list, params: SamplingParams, priority: int) -> Submission:
        return await _submit(worker, prompts, params, metrics, settings.request_timeout, priority)

    def make_reply(submission: Submission, model: str | None, answer) -> Reply:
        return Reply(submission, _engine(worker), "chat.completion", settings.request_timeout, metrics, model=model, answer=answer)

    app.include_router(anthropic_routes(worker, lambda: _engine(worker), submit, make_reply, authorized, _errors, settings.reasoning_budget))
    app.include_router(responses_routes(worker, lambda: _engine(worker), submit, make_reply, authorized, _errors, settings.reasoning_budget,
                                        store))
    if store is not None:
        app.include_router(batch_routes(store, worker, authorized, _errors, settings.max_upload))
    return app


def _resume_when_loaded(store: Store, worker: EngineWorker) -> None:
    worker.ready.wait()
    if worker.engine is not None:
        resume_batches(store, worker)


# -- the OpenAPI document: every answer a route can give -----------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorBody(BaseModel):
    error: ErrorDetail


_WHY = {
    400: "Invalid JSON, fields or prompt, or more sequences than --max-queue (OpenAI error body)",
    401: "Missing or wrong API key (only with --api-key)",
    404: "Not found: a model that is neither the served one nor one of its adapters, or a file or batch id",
    413: "The upload is larger than --max-upload-mb",
    429: "The queue is full (--max-queue); retry after Retry-After seconds",
    500: "The engine failed while generating the answer (the message says how)",
    503: "The model is loading, failed to load, or the engine has stopped",
    504: "The request ran longer than --request-timeout",
}


def _errors(*codes: int, body: type[BaseModel] = ErrorBody) -> dict:
    """The OpenAPI answers of these error statuses (`body`: the error's shape on the route)."""
    return {code: {"model": body, "description": _WHY[code]} for code in codes}


# Generation routes answer JSON, or Server-Sent Events with "stream": true.
_GENERATION = {
    200: {"description": "The answer; with stream: true, Server-Sent Events of chunks, then data: [DONE]",
          "content": {"application/json": {}, "text/event-stream": {"schema": {}}}},
    **_errors(400, 401, 404, 429, 500, 503, 504),
}


def _openapi(app: FastAPI, worker: EngineWorker) -> dict:
    """FastAPI's document, with its default 422 answers removed (invalid requests get 400 here)
    and the token-id bounds of the served model written in once it has loaded."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for operation in (op for path in doc["paths"].values() for op in path.values()):
        operation["responses"].pop("422", None)
    for unused in ("HTTPValidationError", "ValidationError"):
        doc.get("components", {}).get("schemas", {}).pop(unused, None)
    engine = worker.engine
    _bound_token_ids(doc, engine.vocab.n_vocab - 1 if engine else None, engine.ctx.n_ctx_seq if engine else None)
    if engine is not None:  # before that the bounds are unknown: build it again next time
        app.openapi_schema = doc
    return doc


def _bound_token_ids(node, max_id: int | None, max_len: int | None) -> None:
    """Replace the x-token-id / x-token-ids markers with the vocabulary and context bounds."""
    if isinstance(node, dict):
        if node.pop("x-token-id", False) and max_id is not None:
            node["maximum"] = max_id
        if node.pop("x-token-ids", False) and max_len is not None:
            node["maxItems"] = max_len
        for value in node.values():
            _bound_token_ids(value, max_id, max_len)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, max_id, max_len)


def _authorization(api_key: str | None):
    async def check(http: HttpRequest) -> None:
        if api_key is None:
            return
        given = http.headers.get("authorization", "")
        if secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return
        # Anthropic's clients send the key as x-api-key
        if not secrets.compare_digest(http.headers.get("x-api-key", "").encode(), api_key.encode()):
            raise HTTPException(401, "missing or wrong API key (Authorization: Bearer KEY, or x-api-key: KEY)")

    return check


def _engine(worker: EngineWorker) -> BatchEngine:
    """The serving engine, or 503 with the reason there is none."""
    if worker.load_error is not None:
        raise HTTPException(503, f"the model failed to load: {worker.load_error}")
    if worker.broken is not None:
        raise HTTPException(503, worker.broken)
    if worker.engine is None:
        raise HTTPException(503, "the model is loading")
    return worker.engine


def _served(model: str | None, worker: EngineWorker) -> None:
    """404 for a model not served here, 400 for an adapter's name where adapters do not apply."""
    try:
        check_base_model(model, _engine(worker))
    except LlamabatchError as e:
        raise HTTPException(refusal_status(e), str(e)) from None


async def _submit(
    worker: EngineWorker, prompts: list, params: SamplingParams, metrics: Metrics, timeout: float, priority: int = 0,
) -> Submission:
    """Hand the prompts to the engine and wait until it has taken them (within the request's
    timeout). 429 when the queue is full for now, 400 when the request can never run (a prompt
    refused, more sequences than any queue takes), 503 when the engine has stopped."""
    _engine(worker)
    submission = Submission(loop=asyncio.get_running_loop(), priority=priority)
    try:
        worker.submit(submission, prompts, [params] * len(prompts))
        await asyncio.wait_for(submission.submitted, timeout=max(0.0, submission.t_start + timeout - time.perf_counter()))
    except QueueFull as e:
        metrics.failed.inc()
        raise HTTPException(429, str(e), headers={"Retry-After": "1"}) from None
    except EngineUnavailable as e:
        metrics.failed.inc()
        raise HTTPException(503, str(e)) from None
    except LlamabatchError as e:  # TooLarge; a chat template the model cannot render
        metrics.failed.inc()
        raise HTTPException(400, str(e)) from None
    except asyncio.TimeoutError:
        worker.cancel(submission)  # queued behind the take, should it still come
        metrics.failed.inc()
        raise HTTPException(504, f"the engine did not take the request within {timeout:g} s") from None
    verdict = failure(submission.sequences)  # prompts refused at once: empty, too long, a bad constraint
    if verdict is not None:
        worker.cancel(submission)
        metrics.failed.inc()
        raise HTTPException(verdict.status, verdict.message)
    return submission


async def _pool(worker: EngineWorker, tokens, pooling: Pooling | None, timeout: float):
    """Texts (or pairs) pooled by the worker beside the running batch: (rows, tokens). 400 for an
    input or model that cannot, 500 when the decode failed, 429, 503 and 504 as for generation."""
    _engine(worker)
    loop = asyncio.get_running_loop()
    submission = PoolingSubmission(loop, tokens, pooling, loop.create_future())
    try:
        worker.pool(submission)
        return await asyncio.wait_for(submission.done, timeout)
    except QueueFull as e:
        raise HTTPException(429, str(e), headers={"Retry-After": "1"}) from None
    except EngineUnavailable as e:
        raise HTTPException(503, str(e)) from None
    except (DecodeError, EngineBroken) as e:
        raise HTTPException(500, str(e)) from None
    except LlamabatchError as e:
        raise HTTPException(refusal_status(e), str(e)) from None
    except asyncio.TimeoutError:
        raise HTTPException(504, f"the embeddings took longer than {timeout:g} s") from None


def _error(status: int, message: str, kind: str | None = None, headers: dict | None = None, anthropic: bool = False) -> JSONResponse:
    """OpenAI's error body, or Anthropic's on its routes (as its clients read errors)."""
    body = anthropic_error_body(status, message) if anthropic else error_body(status, message, kind)
    return JSONResponse(body, status_code=status, headers=headers)


def _is_anthropic(request: HttpRequest) -> bool:
    return request.url.path.startswith("/v1/messages")
