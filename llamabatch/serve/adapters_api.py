"""LoRA adapters while serving: llama-server's listing (GET /lora-adapters) and vLLM's routes to
load and unload them at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter). Loading
reads files under --lora-dir only (without it, these two routes are off); an adapter in use by a
queued or running request is not unloaded (409). A loaded adapter is a model of its own in
/v1/models, and requests name it as their model or by id in their `lora` field."""

from __future__ import annotations

import math
from pathlib import Path

from fastapi import APIRouter, Depends, HTTPException
from pydantic import BaseModel, Field, StrictFloat, StrictStr

from ..engine.adapters import AdapterInfo
from .requests import Serving


class LoadAdapter(BaseModel):
    """vLLM's body (with the scale requests get when they name it, and the served model it is for)."""

    lora_name: StrictStr = Field(min_length=1)
    lora_path: StrictStr = Field(min_length=1)  # under --lora-dir (a relative path: from it)
    scale: StrictFloat | int = 1.0
    model: StrictStr | None = None


class UnloadAdapter(BaseModel):
    lora_name: StrictStr = Field(min_length=1)
    model: StrictStr | None = None


def adapter_routes(serving: Serving, authorized, errors, lora_dir: Path | None) -> APIRouter:
    router = APIRouter(dependencies=[Depends(authorized)])

    @router.get("/lora-adapters", responses=errors(401, 503))
    async def lora_adapters(model: str | None = None) -> list[dict]:
        """llama-server's listing: the ids a request's `lora` field names, with the default scales."""
        async with serving.using(model) as served:
            facts = serving.engine(served).facts
            default = dict(facts.default_adapters)
            return [{"id": a.id, "name": a.name, "path": str(a.path), "scale": default.get(a.id, 0.0)} for a in facts.adapters]

    @router.post("/v1/load_lora_adapter", responses=errors(400, 401, 403, 404, 503))
    async def load(body: LoadAdapter) -> dict:
        path = _under(lora_dir, body.lora_path)
        if not math.isfinite(body.scale):
            raise HTTPException(400, f"scale must be a finite number, got {body.scale}")
        async with serving.using(body.model) as served:
            if body.lora_name in serving.models.models:
                raise HTTPException(400, f"{body.lora_name!r} is a served model's name: give the adapter another")
            info = await serving.on_engine(served, lambda engine: engine.load_adapter(body.lora_name, path, float(body.scale)))
        return _card(info, "loaded")

    @router.post("/v1/unload_lora_adapter", responses=errors(400, 401, 403, 404, 409, 503))
    async def unload(body: UnloadAdapter) -> dict:
        _under(lora_dir, ".")
        async with serving.using(body.model) as served:
            info = await serving.on_engine(served, lambda engine: engine.unload_adapter(body.lora_name))
        return _card(info, "unloaded")

    return router


def _under(lora_dir: Path | None, given: str) -> Path:
    """The file a load names, which must lie under --lora-dir (403 otherwise, and when there is none)."""
    if lora_dir is None:
        raise HTTPException(403, "adapters are not loaded or unloaded at run time here: start the server with --lora-dir DIR")
    root = lora_dir.resolve()
    path = (root / given).resolve()
    if not path.is_relative_to(root):
        raise HTTPException(403, f"{given} is outside --lora-dir ({lora_dir}): adapters are loaded from under it only")
    return path


def _card(info: AdapterInfo, status: str) -> dict:
    return {"object": "lora_adapter", "id": info.id, "name": info.name, "path": str(info.path), "scale": info.scale, "status": status}
