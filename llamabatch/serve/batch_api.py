"""OpenAI's Files and Batches API on `llamabatch serve`: upload a JSONL file of requests, create a
batch over it, poll it, download its output and error files, cancel it. Batches run inside the
server's engine at batch priority (batch_runs), durable under --data-dir (store)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request as HttpRequest
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr, StringConstraints
from python_multipart.multipart import MultipartParser, parse_options_header

from ..errors import LlamabatchError
from ..jobs.estimate import estimate, stored_tuning
from .batch_runs import BATCH_ENDPOINTS, batch_error, validated_run
from .store import Store, batch_object, page
from .models import ModelPool, Served
from .requests import Serving, refusals
from .worker import EngineWorker

MAX_FIELD_BYTES = 1024  # form fields beside the file (purpose) are short


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: StrictStr
    endpoint: Literal[BATCH_ENDPOINTS]  # type: ignore[valid-type]
    completion_window: Literal["24h"]  # the only window OpenAI offers
    metadata: dict[Annotated[str, StringConstraints(strict=True, max_length=64)],
                   Annotated[str, StringConstraints(strict=True, max_length=512)]] | None = Field(None, max_length=16)


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchError(BaseModel):
    code: str | None
    line: int | None
    message: str | None
    param: str | None


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    expires_at: int
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: dict
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class FileEstimate(BaseModel):
    """What `llamabatch batch --estimate` says of a batch input, on the model that would run it."""

    model: str
    requests: int
    bad_lines: int = Field(description="lines that would fail without running")
    prompt_tokens: int
    max_new_tokens: int = Field(description="the most tokens the requests may generate")
    parallel: int
    kv_bytes: int
    seconds: float | None = Field(description="expected run time, from `llamabatch tune`'s measurement for this model and "
                                               "settings on this machine; null when none is stored")


class UploadForm(BaseModel):
    """The multipart form POST /v1/files takes (parsed as it streams; documented here)."""

    file: bytes = Field(json_schema_extra={"format": "binary"})
    purpose: Literal["batch"]


def batch_routes(store: Store, serving: Serving, authorized: Callable, errors: Callable, max_upload: int) -> APIRouter:
    router = APIRouter(dependencies=[Depends(authorized)])

    def model(row: dict) -> str:
        return batch_model(store, serving.models, row)

    @router.post(
        "/v1/files", response_model=FileObject, responses=errors(400, 401, 413),
        openapi_extra={"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": UploadForm.model_json_schema()}}}},
    )
    async def upload(http: HttpRequest) -> dict:
        file_id, path = store.new_file_path()
        form = await _receive(http, path, max_upload)
        try:
            if form.fields.get("purpose") != "batch":
                raise HTTPException(400, f"purpose must be 'batch' (the only files this server runs), got {form.fields.get('purpose')!r}")
            if form.filename is None:
                raise HTTPException(400, "no 'file' part in the form")
            problem = await asyncio.to_thread(_jsonl_problem, path)
            if problem:
                raise HTTPException(400, f"the file is not JSONL: {problem}")
        except HTTPException:
            path.unlink(missing_ok=True)
            raise
        return (await _found(lambda: store.add_file(file_id, form.filename, "batch", path))).to_openai()

    @router.get("/v1/files", response_model=FileList, responses=errors(400, 401))
    async def list_files(purpose: str | None = None, limit: int = Query(10000, ge=1, le=10000), after: str | None = None,
                         order: Literal["asc", "desc"] = "desc") -> dict:
        files, more = await _found(lambda: store.files(purpose, limit, after, order == "asc"))
        return page([f.to_openai() for f in files], more)

    @router.get("/v1/files/{file_id}", response_model=FileObject, responses=errors(401, 404))
    async def get_file(file_id: str) -> dict:
        return (await _found(lambda: store.file(file_id))).to_openai()

    @router.delete("/v1/files/{file_id}", response_model=FileDeleted, responses=errors(400, 401, 404))
    async def delete_file(file_id: str) -> dict:
        await _found(lambda: store.delete_file(file_id))
        return {"id": file_id, "object": "file", "deleted": True}

    @router.get("/v1/files/{file_id}/content", response_class=FileResponse, responses={
        200: {"content": {"application/octet-stream": {}}, "description": "The file's bytes"}, **errors(401, 404)})
    async def file_content(file_id: str):
        stored = await _found(lambda: store.file(file_id))
        return FileResponse(stored.path, media_type="application/octet-stream", filename=stored.filename)

    @router.get("/v1/files/{file_id}/estimate", response_model=FileEstimate, responses=errors(400, 401, 404, 503))
    async def estimate_file(file_id: str) -> dict:
        """llamabatch's own: a batch input's size and expected time before it runs, tokenized as
        the batch would tokenize it, on the model its first line names."""
        source = await _found(lambda: store.file(file_id))
        served = await serving.acquire(await asyncio.to_thread(_first_model, source.path))
        try:
            engine = served.worker.engine
            with refusals():
                guess = await asyncio.to_thread(lambda: estimate(engine, source.path, None, stored_tuning(engine)))
        finally:
            serving.models.release(served)
        return {"model": served.name, **guess.to_dict()}

    @router.post("/v1/batches", response_model=BatchObject, responses=errors(400, 401, 404, 503))
    async def create_batch(body: BatchCreate) -> dict:
        source = await _found(lambda: store.file(body.input_file_id))
        if source.purpose != "batch":
            raise HTTPException(400, f"file {source.id} has purpose {source.purpose!r}: a batch reads a file of purpose 'batch'")
        served = await serving.acquire(await asyncio.to_thread(_first_model, source.path))  # loaded, and held until the run is queued
        try:
            row = await _found(lambda: store.add_batch(source.id, body.endpoint, body.metadata))
        except BaseException:
            serving.models.release(served)
            raise
        asyncio.ensure_future(_start_held(store, serving, served, row))
        return batch_object(row, served.name)

    @router.get("/v1/batches/{batch_id}", response_model=BatchObject, responses=errors(401, 404))
    async def get_batch(batch_id: str) -> dict:
        row = await _found(lambda: store.batch(batch_id))
        return batch_object(row, await asyncio.to_thread(model, row))

    @router.get("/v1/batches", response_model=BatchList, responses=errors(400, 401))
    async def list_batches(limit: int = Query(20, ge=1, le=100), after: str | None = None) -> dict:
        rows, more = await _found(lambda: store.batches(limit, after))
        names = await asyncio.to_thread(lambda: [model(r) for r in rows])
        return page([batch_object(r, name) for r, name in zip(rows, names)], more)

    @router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject, responses=errors(400, 401, 404))
    async def cancel_batch(batch_id: str) -> dict:
        row = await _found(lambda: store.cancel_batch(batch_id))
        name = await asyncio.to_thread(model, row)
        served = serving.models.models.get(name)
        if served is not None and served.worker is not None:  # (a model not loaded runs none of its batches)
            served.worker.cancel_batch(batch_id)
        return batch_object(row, name)

    return router


def start_batch(store: Store, worker: EngineWorker, row: dict) -> None:
    """Validate and start a batch (off the event loop: it reads the whole input). Whatever goes
    wrong fails this batch, stated in its errors, and no other."""
    try:
        run = validated_run(store, worker.engine, row)
    except Exception as e:  # noqa: BLE001 - the input vanished, the disk failed: the batch says so
        store.update_batch(row["id"], status="failed", errors=[batch_error("batch_failed", f"{type(e).__name__}: {e}")])
        return
    if run is not None:
        worker.run_batch(run)


async def _start_held(store: Store, serving: Serving, served: Served, row: dict) -> None:
    try:
        await asyncio.to_thread(start_batch, store, served.worker, row)
    finally:
        serving.models.release(served)


async def resume_batches(store: Store, serving: Serving) -> None:
    """At start: every batch a stopped (or killed) server left unfinished, on its model (loaded
    for it); one whose model cannot load stays unfinished, for the next start."""
    for row in await asyncio.to_thread(store.unfinished_batches):
        try:
            served = await serving.models.acquire(await asyncio.to_thread(batch_model, store, serving.models, row))
        except LlamabatchError:
            continue
        await _start_held(store, serving, served, row)


def batch_model(store: Store, models: ModelPool, row: dict) -> str:
    """The model a batch runs on: the one its first line names (OpenAI's batches hold one
    model's requests); the server's only model, or its default, when it names none."""
    if not models.several:
        return models.default
    try:
        name = _first_model(store.file(row["input_file_id"]).path)
        return models.resolve(name).name
    except (LlamabatchError, OSError):
        return models.default


def _first_model(path: Path) -> str | None:
    """The `model` in the body of a batch input's first request, if it reads."""
    try:
        with open(path) as f:
            line = next((text for text in f if text.strip()), "")
        body = json.loads(line).get("body") if line else None
        model = body.get("model") if isinstance(body, dict) else None
        return model if isinstance(model, str) else None
    except (OSError, ValueError, AttributeError):
        return None


async def _found(call: Callable):
    """The store call's answer, made on a worker thread (a commit's fsync would stall every stream
    on the event loop); 404 for an unknown id, 400 for a refusal."""
    with refusals():
        return await asyncio.to_thread(call)


class _Form:
    """A multipart/form-data body as it streams in: the `file` part written to disk, other
    fields kept (short)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self._file = None
        self._header, self._value = b"", b""
        self._headers: dict[bytes, bytes] = {}
        self._name: str | None = None
        self._data = bytearray()

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self._begin, "on_part_data": self._part_data, "on_part_end": self._end,
            "on_header_field": lambda d, a, b: setattr(self, "_header", self._header + d[a:b]),
            "on_header_value": lambda d, a, b: setattr(self, "_value", self._value + d[a:b]),
            "on_header_end": self._header_end, "on_headers_finished": self._headers_done,
        }

    def _begin(self) -> None:
        self._headers, self._name, self._data = {}, None, bytearray()

    def _header_end(self) -> None:
        self._headers[self._header.lower()] = self._value
        self._header, self._value = b"", b""

    def _headers_done(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = options.get(b"name", b"").decode(errors="replace")
        if self._name == "file":
            self.filename = Path(options.get(b"filename", b"upload.jsonl").decode(errors="replace")).name or "upload.jsonl"
            self._file = self.path.open("wb")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name == "file":
            self._file.write(data[start:end])
        elif len(self._data) + end - start > MAX_FIELD_BYTES:
            raise HTTPException(400, f"form field {self._name!r} is longer than {MAX_FIELD_BYTES} bytes")
        else:
            self._data += data[start:end]

    def _end(self) -> None:
        if self._name == "file":
            self._file.close()
            self._file = None
        elif self._name:
            self.fields[self._name] = self._data.decode(errors="replace")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


async def _receive(http: HttpRequest, path: Path, limit: int) -> _Form:
    """Stream the upload to `path`, never holding it whole; 413 past `limit` bytes."""
    content_type, options = parse_options_header(http.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or b"boundary" not in options:
        raise HTTPException(400, "upload the file as multipart/form-data with fields 'file' and 'purpose'")
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"the upload is {int(declared)} bytes, more than the server takes ({limit}; --max-upload-mb)")
    form = _Form(path)
    parser = MultipartParser(options[b"boundary"], form.callbacks())
    received = 0
    try:
        async for chunk in http.stream():
            received += len(chunk)
            if received > limit:
                raise HTTPException(413, f"the upload is more than the server takes ({limit} bytes; --max-upload-mb)")
            parser.write(chunk)
        parser.finalize()
    except Exception as e:  # noqa: BLE001 - over the limit, or a malformed body: nothing is kept
        form.close()
        path.unlink(missing_ok=True)
        if isinstance(e, HTTPException):
            raise
        raise HTTPException(400, f"the multipart body cannot be read: {e}") from None
    form.close()
    return form


def _jsonl_problem(path: Path) -> str | None:
    """The first line that is not a JSON object (with its number), or None."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                return f"line {n} is not JSON"
            if not isinstance(obj, dict):
                return f"line {n} is not a JSON object"
    return None
