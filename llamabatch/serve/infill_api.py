"""llama-server's /infill: the middle of a gap in code, for editors (llama.vscode, llama.vim and
others written against llama-server), in llama-server's request and answer shapes; batched as
every request is. OpenAI's `suffix` on /v1/completions asks the same (openai_format)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Request as HttpRequest
from pydantic import Field, StrictBool, StrictInt, StrictStr

from ..engine import BatchEngine, ExtraFile, Infill, Result, SamplingParams
from ..openai_format import Body, EngineInputs, SamplingFields, error_body, prompt_progress, request_params
from .dialects import answer, sse
from .reply import Reply, Translated
from .requests import Serving
from .worker import EngineWorker


class ExtraChunk(Body):
    """Another file's text, as context ahead of the gap."""

    text: StrictStr
    filename: StrictStr = "tmp"


class InfillRequest(SamplingFields):
    """llama-server's /infill body: the sampling fields, and the gap."""

    input_prefix: StrictStr
    input_suffix: StrictStr
    input_extra: list[ExtraChunk] = []
    prompt: StrictStr = ""  # the middle's start, already typed
    n_predict: Annotated[StrictInt, Field(ge=-1)] | None = None  # llama-server's max_tokens (-1: until the context is full)
    n_indent: Annotated[StrictInt, Field(ge=0)] = 0  # lines after the first indented at least this much (TextStream)
    t_max_predict_ms: Annotated[StrictInt, Field(ge=0)] = 0  # no new line begun after this long generating (0: none)
    samplers: list[StrictStr] | None = None  # llama-server's chain, in this order (sampling.chain)
    response_fields: list[StrictStr] | None = None  # only these fields of the answer ("timings/prompt_n": nested)
    # What llama-server's clients send that changes nothing here: slots are the engine's to choose
    # (the one holding the longest shared prefix), every prompt is reused, and llama-server does
    # not hold a prompt to a time either.
    id_slot: Annotated[StrictInt, Field(ge=-1)] = -1
    cache_prompt: Literal[True] = True
    t_max_prompt_ms: Annotated[StrictInt, Field(ge=-1)] = -1
    spm_infill: StrictBool = False  # suffix before prefix (llama-server's --spm-infill, per request)

    def token_limit(self) -> int | None:
        if self.n_predict is None:
            return self.max_tokens
        return None if self.n_predict == -1 else self.n_predict

    def params(self) -> SamplingParams:
        return replace(super().params(), n_indent=self.n_indent, samplers=None if self.samplers is None else tuple(self.samplers),
                       max_predict_s=self.t_max_predict_ms / 1000 if self.t_max_predict_ms else None)

    def gap(self) -> Infill:
        extra = [ExtraFile(chunk.text, chunk.filename) for chunk in self.input_extra]
        return Infill(self.input_prefix, self.input_suffix, extra, self.prompt, self.spm_infill)


def infill_routes(serving: Serving, authorized, errors) -> APIRouter:
    router = APIRouter(dependencies=[Depends(authorized)])

    @router.post("/infill", responses=errors(400, 401, 404, 429, 500, 503, 504))
    async def infill(body: InfillRequest, http: HttpRequest):
        def translate(engine: BatchEngine) -> Translated:
            params = request_params(body, engine)
            prompt = engine.infill_prompt(body.gap(), params.max_tokens if body.token_limit() is not None else 0)
            return Translated(body, EngineInputs([prompt], params), "infill")

        def whole(reply: Reply) -> dict | list:
            bodies = [_fields(_result(reply, result), body.response_fields) for result in reply.results]
            return bodies[0] if len(bodies) == 1 else bodies  # n samples: a list, as llama-server answers several

        return await answer(serving, body.model, body.stream, http, translate, whole, _events)

    return router


def _result(reply: Reply, result: Result) -> dict:
    """A sequence's answer as llama-server's completion result."""
    timings = result.timings
    prompt_n = result.prompt_tokens - result.cached_tokens
    prompt_s = (timings.ttft_s - timings.queue_s) if timings else 0.0
    predicted_s = timings.decode_s if timings else 0.0
    generated = result.completion_tokens
    stop_type = {"length": "limit"}.get(result.finish_reason, "word" if result.stop_word else "eos")
    return {
        "index": result.sample, "content": result.text, "tokens": result.token_ids, "stop": True,
        "model": reply.model, "tokens_predicted": generated, "tokens_evaluated": result.prompt_tokens, "tokens_cached": result.cached_tokens,
        "stop_type": stop_type, "stopping_word": result.stop_word or "", "truncated": False,
        "timings": {
            "cache_n": result.cached_tokens, "prompt_n": prompt_n, "prompt_ms": 1000 * prompt_s,
            "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else 0.0,
            "predicted_n": generated, "predicted_ms": 1000 * predicted_s,
            "predicted_per_second": generated / predicted_s if predicted_s > 0 else 0.0,
        },
    }


def _fields(result: dict, wanted: list[str] | None) -> dict:
    """llama-server's response_fields: the named fields only, a nested one by its path ("timings/prompt_n")."""
    if wanted is None:
        return result
    picked = {}
    for path in wanted:
        value: object = result
        for key in path.split("/"):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            picked[path] = value
    return picked


async def _events(reply: Reply, worker: EngineWorker) -> AsyncIterator[str]:
    """llama-server's stream: a data line per piece ({"content", "stop": false}), then each
    sequence's whole result with "stop": true; a failure is an error event."""
    try:
        async for event in reply.events(worker):
            if event.progress is not None:
                yield sse({"index": event.sample, "content": "", "stop": False, "prompt_progress": prompt_progress(event.progress)})
            elif event.result is not None:
                reply.raise_if_failed()
                yield sse({**_result(reply, event.result), "content": event.text})
            elif event.text:
                yield sse({"index": event.sample, "content": event.text, "tokens": [event.token], "stop": False})
    except HTTPException as e:
        yield sse(error_body(e.status_code, str(e.detail)))
