"""The embeddings and rerank APIs' shapes, shared by the server and batch jobs: OpenAI's
/v1/embeddings request and list of embedding objects, and the rerank request and results that
llama-server, Jina and Cohere clients use. One place, so a job line's body is the server's answer."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field, StrictBool, StrictStr

from .engine import BatchEngine
from .engine.embedding import Pooling, finish
from .errors import LlamabatchError
from .openai_format import Body, NonEmptyStr, Text, TokenIds, integer

EMBEDDINGS_URL = "/v1/embeddings"  # the endpoint, and the url of its lines in a batch file
# OpenAI's limit on inputs per request (and vLLM's): a longer list is split by the caller.
MAX_INPUTS = 2048


class EmbeddingRequest(Body):
    """OpenAI's /v1/embeddings body, with `truncate` (llama-server's and TEI's): cut an input
    longer than an embedding takes instead of refusing it."""

    model: StrictStr | None = None
    input: Text | TokenIds | list[Text] | list[TokenIds]  # an empty text is refused by name, later
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: integer(ge=1) | None = None
    user: StrictStr | None = None  # accepted, not used, as in completions
    truncate: StrictBool = False

    @property
    def single(self) -> bool:
        """One text (or one list of token ids), rather than a list of them."""
        return isinstance(self.input, str) or bool(self.input) and isinstance(self.input[0], int)

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or a list of token ids."""
        given = self.input
        if self.single:
            return [given]
        if len(given) > MAX_INPUTS:
            raise LlamabatchError(f"input: at most {MAX_INPUTS} inputs a request, got {len(given)}")
        if not given:
            raise LlamabatchError("input: an empty list has nothing to embed")
        return list(given)


@dataclass(frozen=True)
class EmbedSettings:
    """How a job embeds its texts: a job-wide choice, recorded in its manifest."""

    pooling: Pooling | None = None  # None: the GGUF's, else mean
    normalize: bool = True  # unit vectors, as OpenAI's
    dimensions: int | None = None  # for lines that do not say
    truncate: bool = False  # for lines that do not say
    one_per_line: bool = False  # a .parquet or .npy output: a row per line, so one text per line

    def manifest(self) -> dict:
        return {"pooling": self.pooling and self.pooling.value, "normalize": self.normalize,
                "dimensions": self.dimensions, "truncate": self.truncate}


class RerankRequest(Body):
    """The rerank body of llama-server, Jina and Cohere: documents scored against a query."""

    model: StrictStr | None = None
    query: NonEmptyStr
    documents: list[NonEmptyStr] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: integer(ge=1) | None = None
    return_documents: StrictBool = False
    truncate: StrictBool = False


def embedding_tokens(
    engine: BatchEngine, body: EmbeddingRequest, pooling: Pooling | None = None, truncate: bool = False,
) -> list[list[int]]:
    """The tokens each input embeds as; PromptError for an empty or too long one (the request fails)."""
    embedder = engine.embedder(pooling)
    if embedder.pooling is Pooling.RANK:
        raise LlamabatchError(f"{engine.model_name} is a reranker (rank pooling): it scores pairs on /v1/rerank, it does not embed")
    truncate = body.truncate or truncate
    return _each(body.inputs(), lambda text: embedder.tokens(text, truncate))


def rerank_tokens(engine: BatchEngine, body: RerankRequest) -> list[list[int]]:
    """The tokens each (query, document) pair is scored as; a model without a rank head is refused."""
    embedder = engine.embedder(Pooling.RANK)
    return _each(body.documents, lambda doc: embedder.pair_tokens(body.query, doc, body.truncate))


def _each(items: list, tokens) -> list[list[int]]:
    """tokens(item) for each item; a refusal names the item's index when there are several."""
    lists = []
    for i, item in enumerate(items):
        try:
            lists.append(tokens(item))
        except LlamabatchError as e:
            raise type(e)(f"input {i}: {e}" if len(items) > 1 else str(e)) from None
    return lists


def embeddings_body(
    outputs: list[np.ndarray], body: EmbeddingRequest, model: str, prompt_tokens: int, settings: EmbedSettings = EmbedSettings(),
) -> dict:
    """OpenAI's answer: an input's unit vector (cut to `dimensions` first; under pooling none, a
    list of them, one per token, as llama-server's /embeddings answers), as floats or base64 float32."""
    dimensions = body.dimensions or settings.dimensions
    vectors = [finish(output, settings.normalize, dimensions) for output in outputs]
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    # base64 of little-endian float32, which the openai client decodes with numpy.frombuffer
    return base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64" else vector.tolist()


def rerank_body(scores: list[float], body: RerankRequest, model: str, prompt_tokens: int) -> dict:
    """The documents by relevance, best first (the first label's score: "yes" for Qwen3 rerankers)."""
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[: body.top_n]
    results = [{"index": i, "relevance_score": float(scores[i]),
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in order]
    return {"object": "list", "model": model, "results": results,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
