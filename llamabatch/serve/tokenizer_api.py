"""The server's tokenizer, in the shapes clients read: vLLM's (POST /tokenize, POST /detokenize,
GET /tokenizer_info, which lm-evaluation-harness probes to use the server's tokenizer instead of
downloading one) and llama-server's ({"content"} in, {"tokens"} / {"content"} out)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends, HTTPException
from pydantic import BaseModel, Field, StrictBool

from ..engine import BatchEngine
from ..errors import LlamabatchError
from ..openai_format import Text, TokenId


class VllmTokenize(BaseModel):
    """vLLM's shape."""

    prompt: Text
    add_special_tokens: StrictBool = True


class LlamaServerTokenize(BaseModel):
    """llama-server's shape."""

    content: Text
    add_special: StrictBool = False


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    tokens: list[TokenId] = Field(max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    prompt: str  # vLLM's name
    content: str  # llama-server's


def tokenizer_routes(engine: Callable[[], BatchEngine], authorized, errors: Callable[..., dict]) -> APIRouter:
    """Routes that read the engine's vocabulary (read-only, so safe beside the engine thread)."""
    router = APIRouter(dependencies=[Depends(authorized)])

    @router.post("/tokenize", responses=errors(400, 401, 503))
    async def tokenize(body: VllmTokenize | LlamaServerTokenize) -> TokenizeResponse:
        text, special = (body.prompt, body.add_special_tokens) if isinstance(body, VllmTokenize) else (body.content, body.add_special)
        current = engine()
        tokens = current.vocab.tokenize(text, add_special=special)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=current.ctx.n_ctx_seq)

    @router.post("/detokenize", responses=errors(400, 401, 503))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        try:
            text = engine().vocab.detokenize(body.tokens)
        except LlamabatchError as e:
            raise HTTPException(400, str(e)) from None
        return DetokenizeResponse(prompt=text, content=text)

    @router.get("/tokenizer_info", responses=errors(401, 503))
    async def tokenizer_info() -> dict:
        current = engine()
        vocab = current.vocab
        return {
            "tokenizer_class": "llama.cpp", "eos_token": vocab.text(vocab.eos), "bos_token": vocab.text(vocab.bos),
            "pad_token": vocab.text(vocab.pad if vocab.pad >= 0 else vocab.eos), "add_bos_token": vocab.add_bos, "model_max_length": current.ctx.n_ctx_seq,
            "chat_template": current.chat.template.source if current.chat else None, "vocab_size": vocab.n_vocab,
        }

    return router
