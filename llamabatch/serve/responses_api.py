"""OpenAI's Responses API: POST /v1/responses (whole, or streamed as its typed events),
GET and DELETE /v1/responses/{id}, for the official client's `responses.create` and the agent
tools that speak it.

As Anthropic's route does, a request is translated into the chat request it means (instructions,
input items, function tools and calls, a stored conversation continued by previous_response_id)
and runs as /v1/chat/completions runs it; the answer comes back as output items: reasoning,
message, function calls. Responses are kept in the server's store (--data-dir) unless `store`
is false."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Literal, Union

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request as HttpRequest
from pydantic import Field, StrictBool, StrictStr

from ..chat.conversation import Answer
from ..engine import BatchEngine, Result
from ..errors import LlamabatchError
from ..openai_format import AudioPart, Body, ChatRequest, NonEmptyStr, Text, engine_inputs, integer, number, usage
from .dialects import Blocks, answer, sse
from .replay import Kept
from .reply import Reply, Translated
from .requests import Serving, refusals
from .store import Store
from .worker import EngineWorker


class InputText(Body):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list | None = None  # an earlier output's, sent back
    logprobs: list | None = None


class InputImage(Body):
    type: Literal["input_image"]
    image_url: StrictStr  # a data: URL, or an http(s) one where the server fetches them
    detail: Literal["auto", "low", "high"] | None = None

    def part(self) -> dict:
        """The image as a chat message's content part."""
        return {"type": "image_url", "image_url": {"url": self.image_url}}


class InputAudio(AudioPart):
    """A clip: Responses' input_audio part is the chat's, field for field."""

    def part(self) -> dict:
        """The clip as a chat message's content part."""
        return self.model_dump()


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[Annotated[InputText | InputImage | InputAudio, Field(discriminator="type")]]
    id: StrictStr | None = None
    status: StrictStr | None = None
    phase: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content if isinstance(part, InputText))

    def chat_content(self) -> str | list[dict]:
        """Its content as a chat message's: its text, or, with images or clips, text and media parts in order."""
        if isinstance(self.content, str) or all(isinstance(part, InputText) for part in self.content):
            return self.text()
        return [{"type": "text", "text": part.text} if isinstance(part, InputText) else part.part() for part in self.content]


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: StrictStr
    name: NonEmptyStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: Text | list[InputText]
    id: StrictStr | None = None
    status: StrictStr | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningText(Body):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(Body):
    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: StrictStr | None = None
    status: StrictStr | None = None


class FunctionTool(Body):
    type: Literal["function"]
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None  # calls are held to the schema either way


class NamedFunction(Body):
    type: Literal["function"]
    name: StrictStr


class TextFormat(Body):
    type: Literal["text", "json_schema", "json_object"]
    name: StrictStr | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: StrictStr | None = None  # one verbosity here


class ReasoningConfig(Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: StrictStr | None = None  # thoughts come whole, as reasoning_text; no summaries are written


class ResponsesRequest(Body):
    model: StrictStr
    input: Text | list[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: integer(ge=1) | None = None
    temperature: number(ge=0, le=2) | None = None
    top_p: number(gt=0, le=1) | None = None
    stream: StrictBool = False
    background: StrictBool = False  # it outlives its connection: followed again, asked after, or cancelled by id
    previous_response_id: StrictStr | None = None
    store: StrictBool = True
    metadata: dict[StrictStr, StrictStr] | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    user: StrictStr | None = None
    truncation: Literal["disabled"] | None = None  # a conversation longer than the context is refused, never cut
    service_tier: StrictStr | None = None
    # Extra output asked for: none of it applies here (thoughts come in plain text, never
    # encrypted), and what would (log-probabilities) is refused by omission.
    include: list[Literal["reasoning.encrypted_content"]] | None = None

    def conversation(self) -> list[dict]:
        """This request's input as chat messages (without the instructions, which apply to
        this response only): consecutive function calls and an assistant's text are one
        assistant turn, a reasoning item is that turn's thought."""
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        messages: list[dict] = []
        thought = None
        for item in items:
            if isinstance(item, ReasoningItem):
                thought = "".join(part.text for part in item.content or item.summary)
                continue
            if isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
                continue
            turn = messages[-1] if messages and messages[-1]["role"] == "assistant" and isinstance(item, FunctionCallItem) else None
            if isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                if turn is None:
                    turn = {"role": "assistant", "content": None}
                    messages.append(turn)
                turn.setdefault("tool_calls", []).append(call)
            else:
                turn = {"role": item.role, "content": item.chat_content()}
                messages.append(turn)
            if thought is not None and turn["role"] == "assistant":
                turn["reasoning_content"], thought = thought, None
        return messages

    def chat_request(self, earlier: list[dict]) -> ChatRequest:
        """The chat request this one means, after the `earlier` conversation it continues."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        fields: dict = {"model": self.model, "messages": system + earlier + self.conversation(), "stream": self.stream}
        if self.max_output_tokens is not None:
            fields["max_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True)} for t in self.tools]
        if self.tool_choice is not None:
            fields["tool_choice"] = (self.tool_choice if isinstance(self.tool_choice, str)
                                     else {"type": "function", "function": {"name": self.tool_choice.name}})
        if self.text is not None and self.text.format is not None and self.text.format.type != "text":
            form = self.text.format
            if form.type == "json_schema" and form.schema_ is None:
                raise LlamabatchError("text.format: type json_schema needs a schema")
            fields["response_format"] = {"type": "json_object", "schema": form.schema_ or {"type": "object"}}
        if self.reasoning is not None and self.reasoning.effort == "none":
            fields["reasoning_budget"] = 0
        return ChatRequest.model_validate(fields)


def output_items(message: dict) -> list[dict]:
    """An assistant message (Answer.message) as the Responses API's output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or ():
        items.append(_call_item(call))
    return items


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def response_object(
    body: ResponsesRequest, response_id: str, created: float, output: list[dict], status: str, results: list[Result] | None = None,
) -> dict:
    """The response object: in progress (no output yet), or completed or incomplete with its usage."""
    tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters or {"type": "object", "properties": {}},
              "strict": t.strict if t.strict is not None else True} for t in body.tools or ()]
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) else body.tool_choice or "auto"
    obj = {"id": response_id, "object": "response", "created_at": created, "status": status, "model": body.model, "output": output,
           "instructions": body.instructions, "tools": tools, "tool_choice": choice,
           "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
           "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
           "previous_response_id": body.previous_response_id, "metadata": body.metadata or {}, "store": body.store,
           "background": body.background,
           "text": {"format": {"type": "text"}} if body.text is None else body.text.model_dump(by_alias=True, exclude_none=True),
           "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None, "usage": None}
    if results:
        counted = usage(results)
        obj["usage"] = {"input_tokens": counted["prompt_tokens"], "output_tokens": counted["completion_tokens"],
                        "total_tokens": counted["total_tokens"],
                        "input_tokens_details": {"cached_tokens": counted["prompt_tokens_details"]["cached_tokens"], "cache_write_tokens": 0},
                        "output_tokens_details": {"reasoning_tokens": 0}}
        obj["completed_at"] = time.time()
    return obj


def responses_routes(serving: Serving, authorized, errors, reasoning_budget: int, store: Store | None) -> APIRouter:
    router = APIRouter(dependencies=[Depends(authorized)])

    def keep(body: ResponsesRequest, chat: ChatRequest, obj: dict, message: dict) -> None:
        """Store a finished response with its conversation (instructions apart: they are this response's)."""
        if store is None or not body.store:
            return
        conversation = [m.rendered() for m in chat.messages if not (body.instructions and m is chat.messages[0])]
        store.add_response(obj, conversation + [{k: v for k, v in message.items() if v is not None}])

    @router.post("/v1/responses", responses=errors(400, 401, 404, 429, 500, 503, 504))
    async def create(body: ResponsesRequest, http: HttpRequest):
        response_id, created = _id("resp"), time.time()

        def translate(engine: BatchEngine) -> Translated:
            earlier = []
            if body.previous_response_id is not None:
                if store is None:
                    raise LlamabatchError("previous_response_id: this server keeps no responses (it has no --data-dir)")
                earlier = store.response(body.previous_response_id)[1]
            chat = body.chat_request(earlier)
            return Translated(chat, engine_inputs(chat, engine, reasoning_budget, serving.fetch))

        async def whole(reply: Reply) -> dict:
            result = reply.results[0]
            message = reply.answer.message(result.text)
            status = "incomplete" if result.finish_reason == "length" else "completed"
            obj = response_object(body, response_id, created, output_items(message), status, reply.results)
            await asyncio.to_thread(keep, body, reply.request, obj, message)
            return obj

        async def events(reply: Reply, worker: EngineWorker) -> AsyncIterator[str]:
            """The Responses API's stream: response.created and .in_progress; per output item its
            .output_item.added, content part, deltas (.reasoning_text, .output_text,
            .function_call_arguments) and their .done events, .output_item.done; then .completed
            (or .incomplete when max_output_tokens cut it). A failure after the start is response.failed."""
            items = _Items()
            start = response_object(body, response_id, created, [], "in_progress")
            yield items.send("response.created", response={**start, "status": "queued"} if body.background else start)
            yield items.send("response.in_progress", response=start)
            deltas: list[dict] = []
            try:
                async for delta in reply.answer_deltas(worker):
                    deltas.append(delta)
                    for chunk in items.feed(delta):
                        yield chunk
            except HTTPException as e:
                failed = {**start, "status": "failed", "error": {"code": "server_error" if e.status_code >= 500 else "invalid_prompt",
                                                                  "message": str(e.detail)}}
                yield items.send("response.failed", response=failed)
                return
            for chunk in items.close():
                yield chunk
            status = "incomplete" if reply.results[0].finish_reason == "length" else "completed"
            obj = response_object(body, response_id, created, items.items, status, reply.results)
            await asyncio.to_thread(keep, body, reply.request, obj, Answer.assembled(deltas))
            yield items.send(f"response.{status}", response=obj)

        if not body.background:
            return await answer(serving, body.model, body.stream, http, translate, whole, events)
        detached = await answer(serving, body.model, body.stream, http, translate, whole, events, background=response_id)
        return detached if body.stream else _latest(detached) or response_object(body, response_id, created, [], "queued")

    @router.get("/v1/responses/{response_id}", responses={**errors(400, 401, 404, 410), 200: {"content": {
        "application/json": {}, "text/event-stream": {"schema": {}}}}})
    async def get(response_id: str, stream: bool = False, starting_after: int | None = Query(None, ge=-1),
                  last_event_id: int | None = Header(None, ge=-1)):
        """The response: while a background one runs (and --resume-keep seconds after), as far as
        it has come; with stream=true, its events after sequence number `starting_after` (or the
        Last-Event-ID header) as they come. Else as the store kept it."""
        kept = serving.replays.find(response_id)
        if stream:
            if kept is None:
                raise HTTPException(404, f"response {response_id!r} has no stream kept here: a background response's is, "
                                         "while it runs and for --resume-keep seconds after")
            return serving.follow(kept, serving.replays.last_read(starting_after, last_event_id))
        if kept is not None:
            return _latest(kept) or {"id": response_id, "object": "response", "status": "queued"}
        return (await asyncio.to_thread(_stored, store, response_id))[0]

    @router.post("/v1/responses/{response_id}/cancel", responses=errors(400, 401, 404))
    async def cancel(response_id: str) -> dict:
        """A background response's sequences cancelled; it answers as it then stands."""
        kept = serving.replays.find(response_id)
        if kept is None:
            await asyncio.to_thread(_stored, store, response_id)  # 404 for none at all
            raise HTTPException(400, f"response {response_id!r} is not a running background response: only those can be cancelled")
        await serving.replays.cancel(kept)
        return _latest(kept) or {"id": response_id, "object": "response", "status": "cancelled"}

    @router.delete("/v1/responses/{response_id}", responses=errors(401, 404))
    async def delete(response_id: str) -> dict:
        await asyncio.to_thread(_stored, store, response_id)
        await asyncio.to_thread(store.delete_response, response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router


def _latest(kept: Kept) -> dict | None:
    """A background response as far as it has come: the response object its latest event
    carries (None before its first), "cancelled" once cancelled, "failed" when its stream ended
    without a last word (it broke: never left "in_progress" for good)."""
    for event in reversed(kept.events):
        data = json.loads(event[event.index("data: ") + 6:])
        if "response" in data:
            response = data["response"]
            if kept.cancelled:
                return {**response, "status": "cancelled"}
            if kept.ended is not None and response["status"] in ("queued", "in_progress"):
                return {**response, "status": "failed", "error": {"code": "server_error", "message": "the response ended before it finished"}}
            return response
    return None


def _stored(store: Store | None, response_id: str) -> tuple[dict, list[dict]]:
    if store is None:
        raise HTTPException(404, f"no response with id {response_id!r}: this server keeps no responses (it has no --data-dir)")
    with refusals():
        return store.response(response_id)


class _Items(Blocks):
    """The Responses API's output items as a stream opens and closes them (reasoning, message,
    function calls), and the events' sequence numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.number = 0
        self.items: list[dict] = []  # finished output items
        self.open: dict | None = None

    def send(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return sse(data, kind)

    def opened(self, kind: str) -> list[str]:
        self.open = _reasoning_item("", "in_progress") if kind == "reasoning" else _message_item("", "in_progress")
        index = len(self.items)
        return [self.send("response.output_item.added", output_index=index, item={**self.open, "content": []}),
                self.send("response.content_part.added", item_id=self.open["id"], output_index=index, content_index=0,
                          part=dict(self.open["content"][0]))]

    def added(self, kind: str, text: str) -> list[str]:
        self.open["content"][0]["text"] += text
        at = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0, "delta": text}
        if kind == "reasoning":
            return [self.send("response.reasoning_text.delta", **at)]
        return [self.send("response.output_text.delta", **at, logprobs=[])]

    def closed(self, kind: str) -> list[str]:
        item, self.open = self.open, None
        index = len(self.items)
        part = item["content"][0]
        if kind == "reasoning":
            done = [self.send("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=part["text"])]
        else:
            done = [self.send("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=part["text"], logprobs=[])]
        item["status"] = "completed"
        done.append(self.send("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part))
        done.append(self.send("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        return done

    def called(self, call: dict) -> list[str]:
        item = _call_item(call, "in_progress")
        index = len(self.items)
        out = [self.send("response.output_item.added", output_index=index, item={**item, "arguments": ""}),
               self.send("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"]),
               self.send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                         arguments=item["arguments"], name=item["name"])]
        item["status"] = "completed"
        out.append(self.send("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        return out


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"
