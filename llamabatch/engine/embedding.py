"""Embeddings and rank scores: a second llama.cpp context on the engine's model (the weights are
loaded once), made with `embeddings` on and a pooling type. Many texts go into each llama_decode,
each its own sequence with every token an output; llama.cpp pools each sequence into one vector
(or, under rank pooling, the classifier's scores), read back with llama_get_embeddings_seq.

llama.cpp pools per micro-batch, so a text must fit one: the context's batch and micro-batch are
the same size, and that size is the longest text it takes (longer ones are refused, or cut when
the caller asks to truncate)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from enum import Enum

import llama_cpp
import numpy as np

from ..errors import ConfigError, PromptError
from .config import EMBED_PACK_TOKENS
from .native.handles import Batch, Context, Model

EMBED_TOKENS = 2048  # the longest text an embedding takes by default
MAX_TEXTS_PER_DECODE = 64  # sequences per decode: llama.cpp allows 256; 64 short texts already fill a batch


class Pooling(str, Enum):
    """How a sequence's token vectors become one (llama_pooling_type)."""

    MEAN = "mean"
    CLS = "cls"  # the first token's
    LAST = "last"  # the last token's: decoder models trained for embeddings
    RANK = "rank"  # a classifier head's scores: rerankers
    NONE = "none"  # no pooling: a vector per token (a matrix per text)

    @property
    def native(self) -> int:
        return {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}[self.value]


# A GGUF that says "none" is a plain language model: it gets the default (mean), like one silent.
_FROM_NATIVE = {p.native: p for p in Pooling if p is not Pooling.NONE}


def model_pooling(model: Model) -> Pooling | None:
    """The pooling the GGUF names (`<arch>.pooling_type`), or None when it names none (a plain
    language model: llamabatch then pools by mean)."""
    value = model.meta(f"{model.meta('general.architecture')}.pooling_type")
    return _FROM_NATIVE.get(int(value)) if value is not None and value.lstrip("-").isdigit() else None


class Embedder:
    """One embedding context: pools texts into vectors, many texts per decode.

    >>> with Embedder(model, Pooling.MEAN, n_threads=4) as embedder:
    ...     vectors = embedder.embed([embedder.tokens("a cat"), embedder.tokens("a dog")])
    """

    def __init__(
        self, model: Model, pooling: Pooling, *, n_threads: int, n_tokens: int = EMBED_TOKENS,
        pack_tokens: int = EMBED_PACK_TOKENS, max_texts: int = MAX_TEXTS_PER_DECODE,
    ) -> None:
        native_pooling = model_pooling(model)
        if pooling is Pooling.RANK and native_pooling is not Pooling.RANK:
            raise ConfigError(f"{model.path.name} has no rank head (its GGUF does not set rank pooling): it cannot rerank")
        self.model = model
        self.pooling = pooling
        self.n_tokens = min(n_tokens, model.n_ctx_train)
        self.pack_tokens = min(pack_tokens, self.n_tokens)
        self.max_texts = min(max_texts, llama_cpp.llama_max_parallel_sequences())
        self.ctx = Context(
            model, n_ctx=self.n_tokens, n_batch=self.n_tokens, n_ubatch=self.n_tokens, n_seq_max=self.max_texts,
            n_threads=n_threads, kv_unified=True, pooling=pooling.native,
        )
        # A rank head gives n_cls_out scores per sequence; other pooling, a vector of the model's width.
        n_out = llama_cpp.llama_model_n_cls_out if pooling is Pooling.RANK else llama_cpp.llama_model_n_embd_out
        self.dim = n_out(model.handle)
        self.batch = Batch(self.n_tokens)
        self._vocab = model.vocab
        self.decodes = 0

    def tokens(self, text: str | list[int], truncate: bool = False) -> list[int]:
        """A text's tokens (or token ids, checked), refused when empty or longer than a decode
        takes, or cut to fit when `truncate`."""
        if isinstance(text, str):
            if not text:
                raise PromptError("empty input: there is nothing to embed")
            tokens = self._vocab.tokenize(text)
        else:
            self._vocab.check_ids(text)
            tokens = list(text)
        if not tokens:
            raise PromptError("empty input: there is nothing to embed")
        return self._fit(tokens, truncate)

    def pair_tokens(self, query: str, document: str, truncate: bool = False) -> list[int]:
        """A (query, document) pair as a reranker reads it: its GGUF's rerank template when it has
        one, else BOS query EOS SEP document EOS, each special token where the vocabulary adds it
        (as llama.cpp's server builds the pair)."""
        template = llama_cpp.llama_model_chat_template(self.model.handle, b"rerank")
        if template:
            text = template.decode().replace("{query}", query).replace("{document}", document)
            return self._fit(self._vocab.tokenize(text, add_special=False), truncate)
        vocab = self._vocab
        eos = vocab.eos if vocab.eos >= 0 else vocab.sep
        ends = [eos] if vocab.add_eos else []
        tokens = [vocab.bos] if vocab.add_bos else []
        tokens += vocab.tokenize(query, add_special=False) + ends + ([vocab.sep] if vocab.add_sep else [])
        tokens += vocab.tokenize(document, add_special=False) + ends
        return self._fit(tokens, truncate)

    def _fit(self, tokens: list[int], truncate: bool) -> list[int]:
        if len(tokens) > self.n_tokens:
            if not truncate:
                raise PromptError(
                    f"input of {len(tokens)} tokens is longer than the {self.n_tokens} an embedding takes "
                    "(set truncate to cut it)"
                )
            tokens = tokens[: self.n_tokens]
        return tokens

    def embed(self, token_lists: list[list[int]]) -> np.ndarray:
        """Pooled outputs (one row per text, float32), as many texts per decode as fit."""
        if self.pooling is Pooling.NONE:
            raise ConfigError("pooling none gives a matrix per text (a vector per token): use stream() or embed_groups()")
        return np.stack(list(self.stream(token_lists))) if token_lists else np.zeros((0, self.dim), np.float32)

    def embed_groups(self, groups: list[list[list[int]]]) -> list[list[np.ndarray]]:
        """Each group's outputs (a request's texts), the texts of all groups packed together."""
        outputs = self.stream(tokens for group in groups for tokens in group)
        return [[next(outputs) for _ in group] for group in groups]

    def stream(self, token_lists: Iterable[list[int]]) -> Iterator[np.ndarray]:
        """Each text's output in order (its pooled vector; under pooling none a row per token),
        packing texts lazily into decodes."""
        pack: list[list[int]] = []
        filled = 0
        for tokens in token_lists:
            if pack and (filled + len(tokens) > self.pack_tokens or len(pack) == self.max_texts):
                yield from self._decode(pack)
                pack, filled = [], 0
            pack.append(tokens)
            filled += len(tokens)
        if pack:
            yield from self._decode(pack)

    def _decode(self, pack: list[list[int]]) -> list[np.ndarray]:
        rows = [(token, pos, seq) for seq, tokens in enumerate(pack) for pos, token in enumerate(tokens)]
        tokens, positions, seq_ids = (list(column) for column in zip(*rows))
        self.batch.set(tokens, positions, seq_ids, [1] * len(rows))  # pooling needs every row as an output
        self.ctx.clear()
        self.ctx.decode(self.batch)
        self.decodes += 1
        if self.pooling is Pooling.NONE:
            ends = np.cumsum([len(tokens) for tokens in pack])
            return np.split(self.ctx.token_embeddings(len(rows), self.dim), ends[:-1])
        return [self.ctx.embedding(seq, self.dim) for seq in range(len(pack))]

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()

    def __enter__(self) -> Embedder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def finish(vectors: np.ndarray, normalize: bool = True, dimensions: int | None = None) -> np.ndarray:
    """Vectors (the last axis) as a caller asked for them: cut to their first `dimensions`
    (Matryoshka models put the most information first), then scaled to unit length (OpenAI's
    embeddings are)."""
    if dimensions is not None:
        if not 1 <= dimensions <= vectors.shape[-1]:
            raise PromptError(f"dimensions must be between 1 and the model's {vectors.shape[-1]}, got {dimensions}")
        vectors = vectors[..., :dimensions]
    if normalize:
        norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
        vectors = vectors / np.where(norms > 0, norms, 1)
    return np.ascontiguousarray(vectors, dtype=np.float32)
