"""`llamabatch serve`: an OpenAI-compatible HTTP server whose requests share one running batch.

Every request becomes one or more sequences in the engine worker's queue; they join the
batch at its next step and leave when done (continuous batching). Streams are Server-Sent
Events in OpenAI's chunk format. A client that goes away has its sequences cancelled.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from importlib.metadata import version

from fastapi import Depends, FastAPI, HTTPException, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..catalog import Catalog
from ..engine import BatchEngine
from ..engine.embedding import Pooling
from . import remote_media
from ..openai_format import error_body, validation_message
from .access import Access
from .adapters_api import adapter_routes
from .anthropic_api import anthropic_routes, error_body as anthropic_error_body
from .batch_api import batch_routes, resume_batches
from .infill_api import infill_routes
from .metrics import Metrics
from .models import ModelPool, Served
from .openai_api import openai_routes
from .page_api import page_routes
from .requests import Serving, refusals
from .responses_api import responses_routes
from .replay import RESUME_EVENTS, RESUME_KEEP_S, Replays
from .store import Store
from .streams_api import stream_routes
from .tokenizer_api import tokenizer_routes
from .worker import EngineWorker


@dataclass(frozen=True)
class ServerSettings:
    engine: dict  # BatchEngine keyword arguments (model, n_parallel, n_ctx, ...) of the model served (the first, with several)
    access: Access = Access()  # API keys and CORS
    max_queue: int = 256  # sequences (and embedding requests) waiting before requests get 429, per model
    request_timeout: float = 600.0  # seconds until a request is cancelled and answered 504
    keepalive: float | None = 15.0  # seconds of silence after which a stream sends an SSE comment (None: never)
    resume_keep: float = RESUME_KEEP_S  # seconds a stream that outlives its connection is kept after it ends
    resume_events: int = RESUME_EVENTS  # of its latest events
    shutdown_timeout: float = 30.0  # seconds requests may drain as the server stops (serve/shutdown.py)
    pooling: Pooling | None = None  # /v1/embeddings: the GGUF's pooling, else mean, unless set
    data_dir: Path | None = None  # files and batches (OpenAI's Batch API); None: no batch API
    max_upload: int = 200 << 20  # bytes a file upload may have (413 beyond)
    lora_dir: Path | None = None  # LoRA adapters may be loaded at run time from files under it (None: not at all)
    reasoning_budget: int = -1  # a chat request's thought in tokens at most, unless it says (-1: no limit, 0: no thinking)
    allow_remote_media: bool = False  # images named by http(s) URL are fetched (remote_media), else refused
    # Several models (serve.models): each one's BatchEngine keyword arguments by name, `engine`'s
    # among them; loaded on demand, within these limits.
    models: dict[str, dict] = field(default_factory=dict)
    max_loaded: int | None = None
    memory: int | None = None  # bytes the loaded models share
    idle_unload: float | None = None  # seconds without work after which a model sleeps (is unloaded)

    def served(self) -> dict[str, dict]:
        """Every model's engine settings by name, the default first."""
        return self.models or {Catalog.load(self.engine.get("catalog")).resolve(self.engine.get("model")).name: self.engine}

# -- the app -----------------------------------------------------------------------------


def create_app(settings: ServerSettings) -> FastAPI:
    def worker_for(served: Served) -> EngineWorker:
        worker = EngineWorker(lambda: BatchEngine(**served.settings), settings.max_queue, metrics.observer(served.name))
        metrics.watch(served.name, worker)
        return worker

    models = ModelPool(settings.served(), worker_for, max_loaded=settings.max_loaded, memory=settings.memory,
                       idle_unload=settings.idle_unload)
    metrics = Metrics(models.workers)
    metrics.watch_states(models.models.values())
    serving = Serving(models, metrics, settings.request_timeout, settings.keepalive, Replays(settings.resume_keep, settings.resume_events),
                      remote_media.fetch if settings.allow_remote_media else None)
    store = Store(settings.data_dir) if settings.data_dir is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        models.start()  # one model loads now, in its thread: /health says 503 until then
        if store is not None:  # batches a stopped server left unfinished resume once their model is in
            asyncio.ensure_future(resume_batches(store, serving))
        yield
        await models.stop(settings.shutdown_timeout)
        if store is not None:
            store.close()

    app = FastAPI(title="llamabatch", version=version("llamabatch"), lifespan=lifespan)
    app.state.models = models  # a Ray Serve replica starts and stops them itself (no lifespan there)
    authorized = settings.access.authorization()
    settings.access.allow_origins(app)
    app.openapi = lambda: _openapi(app, models)

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
        if not models.several:  # one model: healthy once it serves, or while it sleeps
            served = models.models[models.default]
            if served.state == "sleeping":
                return {"status": "ok", "model": "sleeping"}
            try:
                serving.engine(served)
            except HTTPException as e:
                return _error(e.status_code, str(e.detail))
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {"content": {"text/plain": {}}}},
             dependencies=[Depends(authorized)] if settings.access.private_metrics else [])
    async def metrics_text():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models", dependencies=[Depends(authorized)], responses=_errors(401, 503))
    async def list_models() -> dict:
        if not models.several and models.models[models.default].state != "sleeping":
            serving.engine(models.models[models.default])  # 503 until it has loaded
        cards = []
        for served in models.models.values():
            facts = served.worker.facts if served.worker is not None else None
            status = {"value": served.state, **({"load_s": round(served.load_seconds, 3)} if served.loads else {}),
                      **({"failed": True, "error": served.error} if served.error else {})}
            card = {"id": served.name, "object": "model", "created": 0, "owned_by": "llamabatch", "status": status}
            if facts is not None:
                card["max_model_len"] = facts.n_ctx_seq
                card["memory_bytes"] = facts.memory_bytes
                # vLLM's way: each adapter is a model of its own, its parent the base model
                cards += [card, *({**card, "id": a.name, "parent": served.name, "root": str(a.path)} for a in facts.adapters)]
            else:
                cards.append(card)
        return {"object": "list", "data": cards}

    @app.post("/models/load", dependencies=[Depends(authorized)], responses=_errors(400, 401, 404, 503, 504))
    async def load_model(body: ModelAction) -> dict:
        """llama-server's router route: load a model now (it stays until idle or made room for)."""
        async with serving.using(body.model):
            return {"success": True}

    @app.post("/models/unload", dependencies=[Depends(authorized)], responses=_errors(400, 401, 404, 409))
    async def unload_model(body: ModelAction) -> dict:
        with refusals():
            await models.unload(models.resolve(body.model))
        return {"success": True}

    app.include_router(openai_routes(serving, authorized, _errors, _GENERATION, settings.reasoning_budget, settings.pooling))
    app.include_router(tokenizer_routes(serving, authorized, _errors))
    app.include_router(adapter_routes(serving, authorized, _errors, settings.lora_dir))
    app.include_router(infill_routes(serving, authorized, _errors))
    app.include_router(stream_routes(serving, authorized, _errors))
    app.include_router(page_routes(serving, authorized, _errors, store is not None))
    app.include_router(anthropic_routes(serving, authorized, _errors, settings.reasoning_budget))
    app.include_router(responses_routes(serving, authorized, _errors, settings.reasoning_budget, store))
    if store is not None:
        app.include_router(batch_routes(store, serving, authorized, _errors, settings.max_upload))
    return app


class ModelAction(BaseModel):
    """POST /models/load and /models/unload (llama-server's router shape)."""

    model: str


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
    404: "Not found: a model that is neither a served one nor one of their adapters, or a file or batch id",
    409: "The model has requests in flight: it unloads when they are done",
    403: "Not allowed here: loading adapters at run time without --lora-dir, or a file outside it",
    410: "The stream's events asked for are no longer kept (--resume-events)",
    413: "The upload is larger than --max-upload-mb",
    429: "The queue is full (--max-queue); retry after Retry-After seconds",
    500: "The engine failed while generating the answer (the message says how)",
    503: "The model is loading, failed to load (or has no room to), or its engine has stopped",
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


def _openapi(app: FastAPI, models: ModelPool) -> dict:
    """FastAPI's document, with its default 422 answers removed (invalid requests get 400 here)
    and the token-id bounds of the served model written in once it has loaded (with several
    models, bounds differ by model: none are written)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for operation in (op for path in doc["paths"].values() for op in path.values()):
        operation["responses"].pop("422", None)
    for unused in ("HTTPValidationError", "ValidationError"):
        doc.get("components", {}).get("schemas", {}).pop(unused, None)
    worker = models.models[models.default].worker
    facts = worker.facts if worker is not None and not models.several else None
    _bound_token_ids(doc, facts.n_vocab - 1 if facts else None, facts.n_ctx_seq if facts else None)
    if facts is not None or models.several:  # before the model loads the bounds are unknown: build it again next time
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


def _error(status: int, message: str, kind: str | None = None, headers: dict | None = None, anthropic: bool = False) -> JSONResponse:
    """OpenAI's error body, or Anthropic's on its routes (as its clients read errors)."""
    body = anthropic_error_body(status, message) if anthropic else error_body(status, message, kind)
    return JSONResponse(body, status_code=status, headers=headers)


def _is_anthropic(request: HttpRequest) -> bool:
    return request.url.path.startswith("/v1/messages")
