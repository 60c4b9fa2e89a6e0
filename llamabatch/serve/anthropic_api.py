"""Anthropic's Messages API: POST /v1/messages (whole, or streamed as Anthropic's events) and
POST /v1/messages/count_tokens, for Claude Code and the official `anthropic` client.

A request is translated into the chat request it means (system, content blocks, tool_use and
tool_result blocks, tools, tool_choice, thinking), so it runs exactly as /v1/chat/completions
runs it: the model's template, tool calls held to their schemas, thinking apart. The answer is
translated back into content blocks: thinking, text, tool_use."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from typing import Annotated, Literal, Union

from fastapi import APIRouter, Depends, HTTPException, Request as HttpRequest
from pydantic import BaseModel, Field, StrictBool, StrictStr, model_validator

from ..engine import BatchEngine, Result
from ..errors import LlamabatchError
from ..openai_format import Body, ChatRequest, NonEmptyStr, Text, engine_inputs, integer, number, usage
from .dialects import Blocks, answer, sse
from .reply import Reply, Translated
from .requests import Serving, refusals
from .worker import EngineWorker

# Anthropic's error types by HTTP status (its error body: {"type": "error", "error": {...}})
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorBody(BaseModel):
    """Anthropic's error, as these routes answer one."""

    type: Literal["error"]
    error: ErrorDetail


class CacheControl(Body):
    type: Literal["ephemeral"]
    ttl: StrictStr | None = None  # prefixes are cached by the server as they come; the hint changes nothing


class TextBlock(Body):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None
    citations: None = None


class ImageSource(Body):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: StrictStr


class URLImageSource(Body):
    type: Literal["url"]  # fetched where the server allows it (--allow-remote-media)
    url: StrictStr


class ImageBlock(Body):
    type: Literal["image"]
    source: ImageSource | URLImageSource
    cache_control: CacheControl | None = None

    def part(self) -> dict:
        """The image as an OpenAI content part."""
        if isinstance(self.source, URLImageSource):
            return {"type": "image_url", "image_url": {"url": self.source.url}}
        return {"type": "image_url", "image_url": {"url": f"data:{self.source.media_type};base64,{self.source.data}"}}


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: StrictStr
    name: NonEmptyStr
    input: dict
    cache_control: CacheControl | None = None


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: Text | list[TextBlock] = ""
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(Body):
    type: Literal["thinking"]
    thinking: Text
    signature: StrictStr | None = None


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]
    data: StrictStr


Block = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock], Field(discriminator="type")]


class Message(Body):
    role: Literal["user", "assistant"]
    content: Text | list[Block]

    @model_validator(mode="after")
    def _images_from_the_user(self):
        if self.role == "assistant" and isinstance(self.content, list) and any(isinstance(b, ImageBlock) for b in self.content):
            raise ValueError("image blocks belong to user messages")
        return self

    def openai(self) -> list[dict]:
        """The chat messages this one means: a user turn's tool results first (each a tool
        message), then its text; an assistant turn's text, thinking and tool calls as one message."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        texts = [b.text for b in self.content if isinstance(b, TextBlock)]
        if self.role == "user":
            results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                       for b in self.content if isinstance(b, ToolResultBlock)]
            if any(isinstance(b, ImageBlock) for b in self.content):  # text and images as parts, in order
                parts = [b.part() if isinstance(b, ImageBlock) else {"type": "text", "text": b.text}
                         for b in self.content if isinstance(b, (TextBlock, ImageBlock))]
                return results + [{"role": "user", "content": parts}]
            return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])
        message: dict = {"role": "assistant", "content": "\n".join(texts) if texts else None}
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                 for b in self.content if isinstance(b, ToolUseBlock)]
        if calls:
            message["tool_calls"] = calls
        thoughts = [b.thinking for b in self.content if isinstance(b, ThinkingBlock)]
        if thoughts:
            message["reasoning_content"] = "\n".join(thoughts)
        if message["content"] is None and not calls:
            message["content"] = ""
        return [message]


class Tool(Body):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")]
    description: StrictStr | None = None
    input_schema: dict
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, bash, ...) are not run here
    cache_control: CacheControl | None = None


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(Body):
    type: Literal["enabled", "disabled"]
    budget_tokens: integer(ge=1) | None = None


class Metadata(Body):
    user_id: StrictStr | None = None  # accepted, as Anthropic takes it; not used


class CountTokensRequest(Body):
    model: StrictStr
    messages: list[Message] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def chat(self, **sampling) -> ChatRequest:
        """The chat request this one means (validated as /v1/chat/completions validates it)."""
        system = self.system if isinstance(self.system, str) or self.system is None else "\n".join(b.text for b in self.system)
        messages = ([{"role": "system", "content": system}] if system else []) + [m for message in self.messages for m in message.openai()]
        fields: dict = {"model": self.model, "messages": messages, **sampling}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                                 **({"description": t.description} if t.description else {})}}
                               for t in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            if choice.type == "tool" and not choice.name:
                raise LlamabatchError("tool_choice of type tool needs the tool's name")
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use is not None:
                fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if self.thinking is not None:
            # disabled: no thought; enabled: a thought of budget_tokens at most (none given: no limit)
            fields["reasoning_budget"] = 0 if self.thinking.type == "disabled" else (self.thinking.budget_tokens or -1)
        return ChatRequest.model_validate(fields)


class MessagesRequest(CountTokensRequest):
    max_tokens: integer(ge=1)
    stop_sequences: list[NonEmptyStr] | None = None
    stream: StrictBool = False
    temperature: number(ge=0, le=1) = 1.0
    top_p: number(gt=0, le=1) | None = None
    top_k: integer(ge=0) | None = None
    # Accepted, and the same here whatever they say: one tier, one place, one speed; prefixes are
    # cached as they come (a cache_control hint changes nothing)
    metadata: Metadata | None = None
    service_tier: StrictStr | None = None
    speed: StrictStr | None = None
    inference_geo: StrictStr | None = None
    cache_control: CacheControl | None = None

    def chat_request(self) -> ChatRequest:
        sampling = {"max_tokens": self.max_tokens, "temperature": self.temperature, "stream": self.stream}
        if self.stop_sequences:
            sampling["stop"] = self.stop_sequences
        if self.top_p is not None:
            sampling["top_p"] = self.top_p
        if self.top_k is not None:
            sampling["top_k"] = self.top_k
        return self.chat(**sampling)


def content_blocks(message: dict) -> list[dict]:
    """An OpenAI assistant message (Answer.message) as Anthropic's content blocks."""
    blocks = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"])})
    return blocks


def stop_reason(finish_reason: str | None, called: bool, stop_hit: str | None) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for a sequence's finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if stop_hit is not None:
        return "stop_sequence", stop_hit
    return "end_turn", None


def message_usage(results: list[Result]) -> dict:
    counted = usage(results)
    cached = counted["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": counted["prompt_tokens"] - cached, "output_tokens": counted["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def anthropic_routes(serving: Serving, authorized, errors, reasoning_budget: int) -> APIRouter:
    router = APIRouter(dependencies=[Depends(authorized)])

    @router.post("/v1/messages", responses=errors(400, 401, 404, 429, 500, 503, 504, body=ErrorBody))
    async def messages(body: MessagesRequest, http: HttpRequest):
        def translate(engine: BatchEngine) -> Translated:
            chat = body.chat_request()
            return Translated(chat, engine_inputs(chat, engine, reasoning_budget, serving.fetch))

        return await answer(serving, body.model, body.stream, http, translate, _message, _events)

    @router.post("/v1/messages/count_tokens", responses=errors(400, 401, 404, 503, body=ErrorBody))
    async def count_tokens(body: CountTokensRequest) -> dict:
        async with serving.using(body.model) as served:
            engine = serving.engine(served)

            def count() -> int:
                with refusals():
                    return engine.prompt_length(engine_inputs(body.chat(), engine, reasoning_budget, serving.fetch).prompts[0])

            return {"input_tokens": await asyncio.to_thread(count)}

    return router


def _message(reply: Reply) -> dict:
    """The whole answer: a message of content blocks."""
    result = reply.results[0]
    message = reply.answer.message(result.text)
    reason, hit = stop_reason(result.finish_reason, bool(message.get("tool_calls")), result.stop_word)
    return {"id": _message_id(), "type": "message", "role": "assistant", "model": reply.model,
            "content": content_blocks(message), "stop_reason": reason, "stop_sequence": hit,
            "usage": message_usage(reply.results)}


async def _events(reply: Reply, worker: EngineWorker) -> AsyncIterator[str]:
    """Anthropic's stream: message_start; each content block's start, deltas and stop (thinking,
    text, tool_use, in the order they come); message_delta with the stop reason and usage;
    message_stop. A failure after the start is an error event, as Anthropic sends one."""
    usage_now = {"input_tokens": len(reply.submission.tickets[0].prompt_token_ids), "output_tokens": 0,  # (what a cache holds is known later)
                 "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    start = {"id": _message_id(), "type": "message", "role": "assistant", "model": reply.model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": usage_now}
    yield sse({"type": "message_start", "message": start}, "message_start")
    blocks, called = _Blocks(), False
    try:
        async for delta in reply.answer_deltas(worker):
            called = called or "tool_calls" in delta
            for chunk in blocks.feed(delta):
                yield chunk
    except HTTPException as e:
        yield sse(error_body(e.status_code, str(e.detail)), "error")
        return
    for chunk in blocks.close():
        yield chunk
    result = reply.results[0]
    reason, hit = stop_reason(result.finish_reason, called, result.stop_word)
    yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": hit},
               "usage": message_usage([result])}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")


class _Blocks(Blocks):
    """Anthropic's content blocks (thinking, text, tool_use), numbered as they open."""

    STARTS = {"reasoning": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}

    def __init__(self) -> None:
        super().__init__()
        self.index = -1

    def opened(self, kind: str) -> list[str]:
        return [self._start(self.STARTS[kind])]

    def added(self, kind: str, text: str) -> list[str]:
        delta = {"type": "thinking_delta", "thinking": text} if kind == "reasoning" else {"type": "text_delta", "text": text}
        return [self._delta(delta)]

    def closed(self, kind: str) -> list[str]:
        return [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def called(self, call: dict) -> list[str]:
        self.kind = "tool_call"  # its block stays open until the next delta or the end
        start = self._start({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}})
        return [start, self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]})]

    def _start(self, block: dict) -> str:
        self.index += 1
        return sse({"type": "content_block_start", "index": self.index, "content_block": block}, "content_block_start")

    def _delta(self, delta: dict) -> str:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")


def _message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"
