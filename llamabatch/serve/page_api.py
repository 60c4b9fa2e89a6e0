"""The server's web page (GET /): the engines and batches at work, a playground, batch uploads,
written as one self-contained file (serve/web/index.html: no build step, nothing fetched from
the network). It reads GET /v1/dashboard, a small JSON of what each model's engine last
published (its snapshot: nothing is asked of the engine thread, so an open page costs the engine
nothing), and the server's own OpenAI routes for the rest."""

from __future__ import annotations

import dataclasses
import time
from importlib.resources import files

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse

from .requests import Serving

PAGE = files("llamabatch.serve") / "web" / "index.html"


def page_routes(serving: Serving, authorized, errors, has_store: bool) -> APIRouter:
    router = APIRouter()

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        """The page itself holds no data: it asks for a key when the server wants one."""
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @router.get("/v1/dashboard", dependencies=[Depends(authorized)], responses=errors(401))
    async def dashboard() -> dict:
        """Each model's state, facts, latest snapshot and latest failures (newest first); counters
        are running totals (a page makes rates of two readings)."""
        models = []
        for served in list(serving.models.models.values()):
            worker = served.worker
            facts = worker.facts if worker is not None else None
            snapshot = worker.snapshot if worker is not None else None
            queued, batches = (worker.queued, worker.n_batches) if worker is not None else (0, 0)
            failures = worker.failures if worker is not None else ()
            models.append({
                "name": served.name, "state": served.state, "error": served.error,
                "failures": [dataclasses.asdict(f) for f in reversed(failures)],
                "facts": None if facts is None else {
                    "n_parallel": facts.n_parallel, "n_ctx": facts.n_ctx, "n_ctx_seq": facts.n_ctx_seq,
                    "memory_family": facts.memory_family, "cache_types": [facts.cache_type_k, facts.cache_type_v],
                    "memory_bytes": facts.memory_bytes, "checkpoint_memory": facts.checkpoint_memory,
                    "adapters": [a.name for a in facts.adapters],
                },
                "snapshot": None if snapshot is None else {
                    **{f.name: getattr(snapshot, f.name) for f in dataclasses.fields(snapshot)},
                    "waiting": dict(snapshot.waiting), "running": dict(snapshot.running),
                    "prompt_cache": None if snapshot.prompt_cache is None else dataclasses.asdict(snapshot.prompt_cache),
                    "queued": queued, "batches": batches,
                },
            })
        return {"time": time.time(), "models": models, "batches": has_store}

    return router
