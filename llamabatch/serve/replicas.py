"""`llamabatch serve --replicas N`: N engines behind one OpenAI-compatible endpoint, on Ray Serve.

A thin front deployment takes every HTTP request and hands it, through a Ray Serve handle, to
one `EngineReplica`: each replica is the whole single-engine server (the same app, its own
engine worker), called in-process. Ray Serve's prefix-cache-affinity router picks the replica:
when queues are about even, the one that served the longest prefix of this prompt (its prefix
cache likely holds that KV); otherwise the shorter of two queues. Answers, streams included,
come back chunk by chunk; a client that goes away cancels its sequences in the replica.

Ray is an optional dependency (`pip install "llamabatch[ray]"`): it is imported here only.
"""

# No `from __future__ import annotations`: FastAPI reads the route's parameter types at runtime.
import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

# Ray Serve's public name for this router (ray.serve.llm.request_router) imports vLLM on the
# way; the class itself needs nothing of it.
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter

from .app import ServerSettings, create_app

REPLICA_HEADER = "x-llamabatch-replica"  # which replica answered: for clients, logs and tests


@dataclass(frozen=True)
class Forwarded:
    """One HTTP request on its way to a replica. The router reads `prompt` (text, or chat
    messages) to find the replica that served its prefix before."""

    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    prompt: str | list

    @classmethod
    async def of(cls, request: HttpRequest) -> "Forwarded":
        body = await request.body()
        return cls(request.method, request.url.path, request.url.query, tuple(request.headers.items()), body,
                   _routing_text(body) or f"{request.method} {request.url.path}")


def _routing_text(body: bytes) -> str | list | None:
    """The prompt (completions) or messages (chat) of a generation request, else None."""
    try:
        obj = json.loads(body) if body else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    prompt = obj.get("messages") or obj.get("prompt") or obj.get("prompts")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return "".join(prompt)
    return prompt if isinstance(prompt, (str, list)) and prompt else None


class EngineReplica:
    """One engine and the single-engine app around it (a Ray Serve deployment class)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.app = create_app(settings)
        self.models = self.app.state.models
        self.models.start()
        self.name = serve.get_replica_context().replica_id.unique_id

    def __del__(self) -> None:
        # Ray Serve's shutdown hook for a replica: it deletes the instance when the replica stops.
        self.models.close()

    async def forward(self, request: Forwarded) -> AsyncIterator[tuple[int, list] | bytes]:
        """Runs the request through the app: yields (status, headers) first, then body chunks."""
        messages: asyncio.Queue[dict] = asyncio.Queue()
        gone = asyncio.Event()
        sent_body = False

        async def receive() -> dict:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()  # the app polls this to notice a client that went away
            return {"type": "http.disconnect"}

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
            "method": request.method, "path": request.path, "raw_path": request.path.encode(),
            "query_string": request.query.encode(), "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in request.headers],
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        }
        app = asyncio.create_task(self.app(scope, receive, messages.put))
        try:
            while True:
                message = await messages.get()
                if message["type"] == "http.response.start":
                    headers = [(k.decode(), v.decode()) for k, v in message.get("headers", [])]
                    yield message["status"], headers + [(REPLICA_HEADER, self.name)]
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
        finally:  # done, or the client went away and Ray Serve cancelled this call
            gone.set()
            await app


def front_app(engines: DeploymentHandle) -> type:
    """The front deployment: every route of the single-engine server, answered by a replica."""
    http = FastAPI(title="llamabatch replicas", openapi_url=None, docs_url=None, redoc_url=None)

    @serve.deployment
    @serve.ingress(http)
    class Front:
        def __init__(self, engines: DeploymentHandle) -> None:
            self.engines = engines.options(stream=True)

        @http.api_route("/{path:path}", methods=["GET", "POST"])
        async def any_route(self, path: str, request: HttpRequest) -> StreamingResponse:
            chunks = self.engines.forward.remote(await Forwarded.of(request))
            status, headers = await chunks.__anext__()
            content_type = dict(headers).pop("content-type", None)
            passed = {k: v for k, v in headers if k not in ("content-length", "content-type")}
            return StreamingResponse(chunks, status_code=status, headers=passed, media_type=content_type)

    return Front


def deploy(settings: ServerSettings, replicas: int, threads: int, gpus: float, host: str, port: int, slots: int) -> None:
    """Start Ray Serve on host:port with `replicas` engines of `threads` CPU threads (and `gpus` GPUs) each."""
    serve.start(http_options={"host": host, "port": port})
    engine = {**settings.engine, "n_threads": threads}
    # Prefer the replica that served the longest prefix of the prompt (a third of it or more:
    # a shared template's first words are no reason to pile requests on one replica), unless its
    # queue is a batch longer than another's; a new prompt goes to the least-loaded replica.
    router = RequestRouterConfig(request_router_class=PrefixCacheAffinityRouter,
                                 request_router_kwargs={"imbalanced_threshold": slots, "match_rate_threshold": 0.3})
    engines = serve.deployment(EngineReplica).options(
        name="engine", num_replicas=replicas, ray_actor_options={"num_cpus": threads, "num_gpus": gpus},
        max_ongoing_requests=settings.max_queue + slots, request_router_config=router,
    ).bind(ServerSettings(**{**settings.__dict__, "engine": engine}))
    serve.run(front_app(engines).options(name="front", ray_actor_options={"num_cpus": 0}).bind(engines),
              name="llamabatch", route_prefix="/")
