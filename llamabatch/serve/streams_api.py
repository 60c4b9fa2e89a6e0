"""Coming back to a stream that outlives its connection (a completion, chat or /infill request
sent with X-Background): GET /v1/streams/{id} follows it from the event after the client's
Last-Event-ID (or ?starting_after=N), and POST /v1/streams/{id}/cancel ends it. The Responses
API has its own shape for the same (responses_api)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Header, Query

from .requests import Serving


def stream_routes(serving: Serving, authorized, errors) -> APIRouter:
    router = APIRouter(dependencies=[Depends(authorized)])

    @router.get("/v1/streams/{stream_id}", responses={**errors(400, 401, 404, 410), 200: {"content": {"text/event-stream": {}}}})
    async def follow(stream_id: str, starting_after: int | None = Query(None, ge=-1), last_event_id: int | None = Header(None, ge=-1)):
        """Its events after `starting_after` (else after the Last-Event-ID header; else all that
        are kept), then each new one until it ends."""
        return serving.follow(serving.replays.get(stream_id), serving.replays.last_read(starting_after, last_event_id))

    @router.post("/v1/streams/{stream_id}/cancel", responses=errors(401, 404))
    async def cancel(stream_id: str) -> dict:
        """Cancel its sequences (one that has ended stays as it ended); its events stay kept."""
        kept = serving.replays.get(stream_id)
        await serving.replays.cancel(kept)
        return {"id": kept.id, "object": "stream", "status": "cancelled" if kept.cancelled else "completed", "events": kept.count}

    return router
