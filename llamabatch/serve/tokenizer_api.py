"""The server's tokenizer, in the shapes clients read: vLLM's (POST /tokenize, POST /detokenize,
GET /tokenizer_info, which lm-evaluation-harness probes to use the server's tokenizer instead of
downloading one) and llama-server's ({"content"} in, {"tokens"} / {"content"} out)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field, StrictBool

from ..openai_format import Text, TokenId
from .requests import Serving, refusals


class VllmTokenize(BaseModel):
    """vLLM's shape."""

    prompt: Text
    add_special_tokens: StrictBool = True
    model: str | None = None


class LlamaServerTokenize(BaseModel):
    """llama-server's shape."""

    content: Text
    add_special: StrictBool = False
    model: str | None = None


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    tokens: list[TokenId] = Field(max_length=1 << 20)
    model: str | None = None


class DetokenizeResponse(BaseModel):
    prompt: str  # vLLM's name
    content: str  # llama-server's


def tokenizer_routes(serving: Serving, authorized, errors: Callable[..., dict]) -> APIRouter:
    """Routes that read a model's vocabulary (read-only, so safe beside the engine thread)."""
    router = APIRouter(dependencies=[Depends(authorized)])

    @router.post("/tokenize", responses=errors(400, 401, 404, 503))
    async def tokenize(body: VllmTokenize | LlamaServerTokenize) -> TokenizeResponse:
        text, special = (body.prompt, body.add_special_tokens) if isinstance(body, VllmTokenize) else (body.content, body.add_special)
        async with serving.using(body.model) as served:
            current = serving.engine(served)
            tokens = current.vocab.tokenize(text, add_special=special)
            return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=current.facts.n_ctx_seq)

    @router.post("/detokenize", responses=errors(400, 401, 404, 503))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        async with serving.using(body.model) as served:
            with refusals():
                text = serving.engine(served).vocab.detokenize(body.tokens)
            return DetokenizeResponse(prompt=text, content=text)

    @router.get("/tokenizer_info", responses=errors(401, 404, 503))
    async def tokenizer_info(model: str | None = None) -> dict:
        async with serving.using(model) as served:
            current = serving.engine(served)
            vocab = current.vocab
            return {
                "tokenizer_class": "llama.cpp", "eos_token": vocab.text(vocab.eos), "bos_token": vocab.text(vocab.bos),
                "pad_token": vocab.text(vocab.pad if vocab.pad >= 0 else vocab.eos), "add_bos_token": vocab.add_bos,
                "model_max_length": current.facts.n_ctx_seq,
                "chat_template": current.chat.template.source if current.chat else None, "vocab_size": vocab.n_vocab,
            }

    return router
