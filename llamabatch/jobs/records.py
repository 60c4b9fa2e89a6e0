"""The lines a batch job writes. OpenAI-format input gets OpenAI's batch output objects (the body
is the server's own response object); llamabatch's formats get a compact line per request."""

from __future__ import annotations

import secrets
from collections.abc import Sequence as Seq

import numpy as np

from ..chat.conversation import Answer
from ..embeddings_format import EmbedSettings, embeddings_body
from ..engine import BatchEngine, Result
from ..openai_format import ENDPOINTS, error_body, new_id, response_body, usage
from .inputs import BadLine, Format, JobLine

# Every line records the digest of the request it answers (inputs.request_digest): a resumed job
# checks the input still asks the same before it skips what is written.


def result_record(
    fmt: Format, request: JobLine, results: Seq[Result], engine: BatchEngine, created: int, answer: Answer | None = None,
) -> dict:
    """A finished request's output line (`answer`: how a chat answer's tool calls and reasoning are read)."""
    if fmt is Format.OPENAI:
        kind = ENDPOINTS[request.url][1]
        body = response_body(kind, new_id(kind), created, request.body.model or engine.model_name, results, engine.vocab,
                             request.body.shown(), answer)
        return {"id": _batch_id(), "custom_id": request.id,
                "response": {"status_code": 200, "request_id": _request_id(), "body": body}, "error": None,
                "request_digest": request.digest}
    choices = [{"index": r.sample, "text": r.text, "finish_reason": r.finish_reason, "completion_tokens": r.completion_tokens}
               for r in results]
    return {"id": request.id, "line": request.line, "prompt": request.prompt, "choices": choices, "usage": usage(results),
            "request_digest": request.digest}


def embedding_record(
    fmt: Format, request: JobLine, rows: list[np.ndarray], prompt_tokens: int, model: str, settings: EmbedSettings,
) -> dict:
    """An embedded request's output line: the server's /v1/embeddings body for OpenAI lines, else
    the vector ("embedding"), or the vectors of a list of inputs ("embeddings")."""
    body = embeddings_body(rows, request.embedding, model, prompt_tokens, settings)
    if fmt is Format.OPENAI:
        return {"id": _batch_id(), "custom_id": request.id,
                "response": {"status_code": 200, "request_id": _request_id(), "body": body}, "error": None,
                "request_digest": request.digest}
    vectors = [item["embedding"] for item in body["data"]]
    one = request.embedding.single
    return {"id": request.id, "line": request.line, **({"embedding": vectors[0]} if one else {"embeddings": vectors}),
            "usage": body["usage"], "request_digest": request.digest}


def error_record(fmt: Format, item: JobLine | BadLine, message: str, status: int | None) -> dict:
    """A failed request's error line. `status` is what the server would answer for the same body
    (400 invalid, 404 a model not served, 500 failed while generating), or None for a line that is not a request at all;
    in OpenAI's format a status comes with the server's error body, as OpenAI writes HTTP errors."""
    code = {None: "invalid_line", 400: "invalid_request", 404: "model_not_found"}.get(status, "generation_failed")
    error = {"code": code, "message": message, "line": item.line}
    if fmt is not Format.OPENAI:
        return {"id": item.id, "line": item.line, "error": error, "request_digest": item.digest}
    response = None
    if status is not None:
        response = {"status_code": status, "request_id": _request_id(), "body": error_body(status, message)}
    return {"id": _batch_id(), "custom_id": item.id, "response": response, "error": error, "request_digest": item.digest}


def incomplete_record(record: dict, request: JobLine, message: str) -> dict:
    """A whole answer bound for the error file (`batch --incomplete-errors`): its structured output
    was cut before it was complete, so it is kept, with an error saying why it is not a result."""
    return {**record, "error": {"code": "incomplete_output", "message": message, "line": request.line}}


def _batch_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


def _request_id() -> str:
    return f"req_{secrets.token_hex(12)}"
