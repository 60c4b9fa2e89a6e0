"""OpenAI's API shapes, shared by the server and batch jobs: request bodies (pydantic), what
the engine runs for one, and the completion / chat.completion objects built from its finished
sequences. One place, so a batch job's output body is exactly what the server answers."""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictStr, ValidationError, field_validator, model_validator

from .chat import Tools
from .chat.conversation import Answer
from .engine import MEDIA_MARKER, BatchEngine, MediaPrompt, Infill, Result, SamplingParams, Ticket
from .engine.results import PromptProgress, TokenLogprob
from .engine.sampling.constraints import Constraint
from .engine.native.handles import Vocab
from .engine.sampling.params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_SAMPLES, MAX_SEED, MIN_REPEAT_PENALTY
from .errors import ConstraintError, LlamabatchError, PromptError, SamplingError, UnknownModel

MAX_PRIORITY = 1000  # |priority|: a thousand levels of aging is over 80 minutes


def _json_integer(value):
    """An integer as JSON Schema means it (1.0 counts), never a boolean or a string."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError("Input should be an integer")
    return int(value)


def _json_number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("Input should be a number")
    return value


def integer(ge: int | None = None, le: int | None = None):
    """A JSON integer field within bounds. What the OpenAPI document says is what is accepted:
    pydantic's lax mode would also take false for 0 and "12" for 12, which the document does not
    allow. (The bounds go inside the type, before the validator, to reach the document.)"""
    return Annotated[int, *_bounds(Ge, ge, Le, le), BeforeValidator(_json_integer)]


def number(ge: float | None = None, le: float | None = None, gt: float | None = None):
    """A JSON number field within bounds (see integer)."""
    return Annotated[float, *_bounds(Ge, ge, Le, le, Gt, gt), BeforeValidator(_json_number)]


def _bounds(*pairs) -> list:
    return [kind(value) for kind, value in zip(pairs[::2], pairs[1::2]) if value is not None]


def _unicode(text: str) -> str:
    """JSON lets a string escape half a surrogate pair (\\ud800), which no UTF-8 text holds: the
    tokenizer could not take it."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode: a lone surrogate ({text[e.start]!r}) at character {e.start}") from None
    return text


# Text the model reads (prompts, messages, inputs): a string that is valid Unicode.
Text = Annotated[StrictStr, AfterValidator(_unicode)]
NonEmptyStr = Annotated[StrictStr, Field(min_length=1), AfterValidator(_unicode)]
TokenIdKey = Annotated[StrictStr, Field(pattern=r"^[0-9]{1,9}$")]  # OpenAI's logit_bias keys: token ids as text
# A chat answer with no max_tokens runs until the sequence's context is full ("length"), as
# OpenAI's, vLLM's and llama-server's do; the engine ends it there.
UNTIL_CONTEXT_FULL = 2**31 - 1


class Body(BaseModel):
    """A request body or part of one: a field it does not declare is refused (400, naming it), as
    OpenAI refuses unknown arguments; ignoring one would answer a different question."""

    model_config = ConfigDict(extra="forbid")
# Token ids: the served model's vocabulary size and context bound them; the server writes those
# bounds into its OpenAPI document in place of these markers.
TokenId = Annotated[integer(ge=0), Field(json_schema_extra={"x-token-id": True})]
TokenIds = Annotated[list[TokenId], Field(min_length=1, json_schema_extra={"x-token-ids": True})]


class StreamOptions(Body):
    include_usage: StrictBool = False  # a last chunk with the usage of the whole request


class JsonSchemaFormat(Body):
    name: StrictStr | None = None
    schema_: dict = Field(alias="schema")
    strict: StrictBool | None = None  # the schema is enforced either way: every token is masked by it
    description: StrictStr | None = None


class ResponseFormat(Body):
    """OpenAI's response_format; {"type": "json_object", "schema": ...} is llama-cpp-python's older form."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict | None = Field(None, alias="schema")

    def constraint(self) -> dict:
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ConstraintError("response_format: type json_schema needs a json_schema with a schema")
            return {"json_schema": self.json_schema.schema_}
        if self.type == "json_object":
            return {"json_schema": self.schema_ or {"type": "object"}}
        return {}


class StructuredOutputs(Body):
    """vLLM's structured_outputs (one of them)."""

    json_: dict | StrictStr | None = Field(None, alias="json")
    regex: NonEmptyStr | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    grammar: NonEmptyStr | None = None

    def constraint(self) -> dict:
        given = {"json_schema": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar}
        return {k: v for k, v in given.items() if v is not None}


class LoraEntry(Body):
    """One adapter of llama-server's `lora` field: its id (GET /lora-adapters) and scale."""

    id: integer(ge=0)
    scale: number()


class SamplingFields(Body):
    """OpenAI's sampling fields (their defaults), llama.cpp's top_k and min_p, vLLM's
    prompt_logprobs. The ranges are declared, so the OpenAPI document says what is accepted."""

    model: StrictStr | None = None
    max_tokens: integer(ge=0) = 16
    temperature: number(ge=0) = 1.0
    top_p: number(gt=0, le=1) = 1.0
    top_k: integer(ge=0) = 0
    min_p: number(ge=0, le=1) = 0.0
    seed: integer(ge=0, le=MAX_SEED) | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    presence_penalty: number(ge=-2, le=2) = 0.0
    frequency_penalty: number(ge=-2, le=2) = 0.0
    repetition_penalty: number(ge=MIN_REPEAT_PENALTY) | None = None  # vLLM's name (1 = off)
    repeat_penalty: number(ge=MIN_REPEAT_PENALTY) | None = None  # llama-server's name for the same
    logit_bias: dict[TokenIdKey, number(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)] | None = None
    user: StrictStr | None = None  # the caller's end user, as OpenAI takes it: accepted, not used
    n: integer(ge=1, le=MAX_SAMPLES) = 1
    ignore_eos: StrictBool = False
    prompt_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None  # vLLM: each prompt token's, with alternatives
    stream: StrictBool = False
    return_progress: StrictBool = False  # llama-server's: streams show how far the prompt has been read (prompt_progress)
    # vLLM's: lower runs first, preempting running work of a higher value when no slot is free
    # (serve --scheduling-policy priority; waiting ages it, so no value starves)
    priority: integer(ge=-MAX_PRIORITY, le=MAX_PRIORITY) = 0
    stream_options: StreamOptions | None = None
    # llama-server's LoRA choice: these adapters at these scales, every other at 0 (without it,
    # the server's --lora set). vLLM's way is `model`: an adapter's name, as /v1/models lists it.
    lora: list[LoraEntry] | None = None
    # llama.cpp's further samplers, named as llama-server names them (min_tokens, bad_words: vLLM's);
    # a row that uses one is drawn by a llama.cpp chain of its own. Defaults: off.
    dry_multiplier: number(ge=0) = 0.0
    dry_base: number(ge=1) = 1.75
    dry_allowed_length: integer(ge=1) = 2
    dry_penalty_last_n: integer(ge=-1) = -1
    dry_sequence_breakers: list[NonEmptyStr] = ["\n", ":", '"', "*"]
    xtc_probability: number(ge=0, le=1) = 0.0
    xtc_threshold: number(ge=0, le=1) = 0.1
    mirostat: integer(ge=0, le=2) = 0
    mirostat_tau: number(ge=0) = 5.0
    mirostat_eta: number(gt=0) = 0.1
    typical_p: number(gt=0, le=1) = 1.0
    top_n_sigma: number() = -1.0
    dynatemp_range: number(ge=0) = 0.0
    dynatemp_exponent: number(gt=0) = 1.0
    min_tokens: integer(ge=0) = 0
    bad_words: list[NonEmptyStr] | None = None
    # Constrained output, in each peer's shape: OpenAI, llama-server, vLLM. At most one.
    response_format: ResponseFormat | None = None
    grammar: NonEmptyStr | None = None  # llama-server: GBNF
    json_schema: dict | None = None  # llama-server
    structured_outputs: StructuredOutputs | None = None  # vLLM

    def params(self) -> SamplingParams:
        """The engine's SamplingParams; raises a SamplingError or ConstraintError naming the problem."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        fields = self.model_dump(include=_ENGINE_FIELDS)
        limit = self.token_limit()
        return SamplingParams(
            **fields, max_tokens=UNTIL_CONTEXT_FULL if limit is None else limit, stop=tuple(stop), bad_words=tuple(self.bad_words or ()),
            repeat_penalty=self.repeat_penalty_value(), logprobs=self.logprob_count(),
            prompt_logprobs=self.prompt_logprob_count(), prompt_progress=self.return_progress and self.stream, **self.constraint(),
        )

    def repeat_penalty_value(self) -> float:
        given = {v for v in (self.repetition_penalty, self.repeat_penalty) if v is not None}
        if len(given) > 1:
            raise SamplingError("repetition_penalty and repeat_penalty are one setting: give one, or the same value")
        return given.pop() if given else 1.0

    def constraint(self) -> dict:
        """The one constraint the body asks for, as SamplingParams fields."""
        shapes = {
            "response_format": self.response_format.constraint() if self.response_format else {},
            "grammar": {"grammar": self.grammar} if self.grammar is not None else {},
            "json_schema": {"json_schema": self.json_schema} if self.json_schema is not None else {},
            "structured_outputs": self.structured_outputs.constraint() if self.structured_outputs else {},
        }
        asked = {name: c for name, c in shapes.items() if c}
        if len(asked) > 1 or any(len(c) > 1 for c in asked.values()):
            raise ConstraintError(f"give one constraint, got {', '.join(asked)}")
        return next(iter(asked.values()), {})

    def token_limit(self) -> int | None:
        """Tokens to generate at most; None: until the context is full."""
        return self.max_tokens

    def logprob_count(self) -> int | None:
        return None

    def prompt_logprob_count(self) -> int | None:
        return self.prompt_logprobs

    def shown(self) -> Shown:
        return Shown(prompt_logprobs=self.prompt_logprobs, usage_chunk=bool(self.stream_options and self.stream_options.include_usage))


_ENGINE_FIELDS = {
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "n", "ignore_eos", "logit_bias",
    "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "xtc_probability",
    "xtc_threshold", "mirostat", "mirostat_tau", "mirostat_eta", "typical_p", "top_n_sigma", "dynatemp_range",
    "dynatemp_exponent", "min_tokens",
}


@dataclass(frozen=True)
class Shown:
    """What a response shows besides the generated text, as the request asked."""

    echo: bool = False  # completions: the prompt before the text, and in the log-probabilities
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: alternatives per prompt token
    usage_chunk: bool = False  # streams: a last chunk with the usage


class CompletionRequest(SamplingFields):
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    echo: StrictBool = False  # the prompt before the completion, and its log-probabilities (first: null) with logprobs
    suffix: StrictStr | None = None  # the text after the completion: the prompt is a gap to fill in (engine.infill)
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None  # each token's log-probability and this many alternatives

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        counts = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(counts, default=None)

    def shown(self) -> Shown:
        return replace(super().shown(), echo=self.echo)

    def prompts(self) -> list[str | list[int]]:
        """OpenAI's prompt: a string, a list of strings, a list of token ids, or a list of those."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


ROLES = ("system", "user", "assistant", "tool", "developer")


class TextPart(Body):
    type: Literal["text"]
    text: Text


Fetch = Callable[[str], bytes]  # an http(s) URL's file (remote_media.fetch), where the server fetches them


class ImageURL(Body):
    url: StrictStr  # a data: URL (base64), or an http(s) one where the server fetches them
    detail: Literal["auto", "low", "high"] | None = None  # the projector decides an image's positions

    @field_validator("url")
    @classmethod
    def _inline(cls, url: str) -> str:
        if url.startswith(("http://", "https://")):
            return url
        if not url.startswith("data:"):
            raise ValueError("an image URL is a data: URL (data:image/png;base64,...), or an http(s) one where the server fetches them")
        head, _, data = url.partition(",")
        try:
            if not head.endswith(";base64") or not base64.b64decode(data, validate=True):
                raise binascii.Error
        except binascii.Error:
            raise ValueError("an image's data: URL must hold base64 data (data:image/png;base64,...)") from None
        return url

    def data(self, fetch: Fetch | None) -> bytes:
        if not self.url.startswith("data:"):
            if fetch is None:
                raise PromptError("remote image URLs are not fetched here: send the image in a data: URL (data:image/png;base64,...); "
                                  "serve fetches them with --allow-remote-media")
            return fetch(self.url)
        return base64.b64decode(self.url.partition(",")[2])


class ImagePart(Body):
    type: Literal["image_url"]
    image_url: ImageURL

    def data(self, fetch: Fetch | None) -> bytes:
        return self.image_url.data(fetch)


class InputAudio(Body):
    data: StrictStr  # the clip's file, base64
    format: Literal["wav", "mp3", "flac"]  # (libmtmd tells them apart by their bytes)

    @field_validator("data")
    @classmethod
    def _base64(cls, data: str) -> str:
        try:
            if not base64.b64decode(data, validate=True):
                raise binascii.Error
        except binascii.Error:
            raise ValueError("must be the clip's file in base64 (WAV, MP3, FLAC)") from None
        return data


class AudioPart(Body):
    type: Literal["input_audio"]
    input_audio: InputAudio

    def data(self, fetch: Fetch | None) -> bytes:
        return base64.b64decode(self.input_audio.data)


MEDIA_PARTS = {"image_url": ImagePart, "input_audio": AudioPart}


class FunctionCall(Body):
    name: NonEmptyStr
    arguments: StrictStr  # JSON text, as the model wrote it


class ToolCallIn(Body):
    """A call in an earlier assistant message, sent back with the conversation."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Text | list[TextPart | ImagePart | AudioPart] | None = None  # None: an assistant turn that only called tools
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None  # a tool message: the call it answers
    tool_calls: list[ToolCallIn] | None = None
    reasoning_content: Text | None = None  # an earlier answer's thinking, for templates that show it
    # What the official clients send back when an earlier answer is appended to the messages.
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: Annotated[list, Field(max_length=0)] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts_only(cls, content):
        for i, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") not in ("text", *MEDIA_PARTS):
                raise ValueError(f"content part {i} is of type {part.get('type')!r}: only text, image_url and input_audio parts are supported")
            if isinstance(part, dict) and part.get("type") in MEDIA_PARTS:  # its own complaint, not the text branch's
                try:
                    MEDIA_PARTS[part["type"]].model_validate(part)
                except ValidationError as e:
                    raise ValueError(f"content part {i}: {validation_message(e)}") from None
        return content

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role} ones")
        return self

    def media(self, fetch: Fetch | None) -> list[bytes]:
        """Its images and audio clips, in order (each shown in the rendered text by MEDIA_MARKER);
        those named by http(s) URL fetched with `fetch` (None: they are refused)."""
        return [p.data(fetch) for p in self.content if not isinstance(p, TextPart)] if isinstance(self.content, list) else []

    def rendered(self) -> dict:
        """The message as chat templates read it: parts joined (an image or a clip as
        MEDIA_MARKER, where the projector reads it in), developer read as system."""
        text = self.content if isinstance(self.content, str) or self.content is None else \
            "\n".join(p.text if isinstance(p, TextPart) else MEDIA_MARKER for p in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text or ""}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for name in ("tool_call_id", "name", "reasoning_content"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        return message


class FunctionDef(Body):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON schema for the arguments (none: no arguments)
    strict: StrictBool | None = None  # calls are held to the schema either way


class ToolDef(Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Body):
    name: StrictStr


class ToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: integer(ge=0) | None = None  # none: until the context is full, as OpenAI's chat
    max_completion_tokens: integer(ge=0) | None = None  # what the official clients send now; wins over max_tokens
    logprobs: StrictBool = False
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # OpenAI's default: several calls may come in one answer
    # Variables for the chat template, as vLLM and llama-server take them ({"enable_thinking": false})
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    # A reasoning model's thought, in tokens at most, then closed for it (-1: no limit, 0: no
    # thinking); llama-server's --reasoning-budget, per request. None: the server's default.
    reasoning_budget: integer(ge=-1) | None = None

    def token_limit(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def tool_use(self) -> Tools | None:
        """The request's tools and how they may be used; None without tools."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, ToolChoice) else self.tool_choice
        tools = None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]
        return Tools.of(tools, choice, self.parallel_tool_calls)

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# What each OpenAI endpoint accepts, and the object its answer is.
ENDPOINTS: dict[str, tuple[type[SamplingFields], str]] = {
    "/v1/completions": (CompletionRequest, "text_completion"),
    "/v1/chat/completions": (ChatRequest, "chat.completion"),
}


def validation_message(error: ValidationError | list[dict]) -> str:
    """pydantic's first complaint as one line: 'messages.0.content: Input should be a valid string'."""
    first = (error.errors() if isinstance(error, ValidationError) else error)[0]
    # The path, without "body" and the labels pydantic gives union members ("constrained-str").
    where = ".".join(str(p) for p in first["loc"] if p != "body" and (isinstance(p, int) or p.isidentifier()))
    if first["type"] == "extra_forbidden":
        return f"unknown field {where!r}: llamabatch does not support it"
    message = first["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def check_priority(body: SamplingFields, engine: BatchEngine) -> None:
    """A priority is refused where the engine would ignore it (first come, first served)."""
    if body.priority and engine.config.scheduling != "priority":
        raise SamplingError(f"priority {body.priority} needs --scheduling-policy priority (this engine schedules {engine.config.scheduling})")


def request_params(body: SamplingFields, engine: BatchEngine) -> SamplingParams:
    """The SamplingParams a request body runs with on this engine, its adapters chosen by its
    `model` and `lora` fields. Raises UnknownModel for a model not served here, else a
    LlamabatchError naming the problem (a value out of range, a priority under fcfs)."""
    check_priority(body, engine)
    lora = None if body.lora is None else [(entry.id, entry.scale) for entry in body.lora]
    return replace(body.params(), adapters=engine.adapters.choose(body.model, lora, {engine.model_name}))


def check_base_model(model: str | None, engine: BatchEngine) -> None:
    """Embeddings and reranking come from the served model (with its --lora set): a request that
    names an adapter is refused, not answered from another model than it asked for."""
    if engine.adapters.by_model(model, {engine.model_name}) is not None:  # UnknownModel for neither
        raise LlamabatchError(f"model {model!r} is a LoRA adapter: adapters are chosen per request for generation, not embeddings")


def refusal_status(error: LlamabatchError) -> int:
    """The HTTP status (and job-line status) of a request refused with this error."""
    return 404 if isinstance(error, UnknownModel) else 400


@dataclass(frozen=True)
class EngineInputs:
    """What the engine runs for a request body, and how a chat answer is read back."""

    prompts: list[str | list[int] | MediaPrompt]
    params: SamplingParams
    answer: Answer | None = None  # chat: tool calls and reasoning to parse out of the text


def engine_inputs(body: SamplingFields, engine: BatchEngine, reasoning_budget: int = -1, fetch: Fetch | None = None) -> EngineInputs:
    """The prompts and sampling parameters the engine runs for a request body (`reasoning_budget`:
    the default of chat requests that give none; `fetch`: how images named by http(s) URL are
    had, None where they are refused). Raises a LlamabatchError naming the problem (empty prompt,
    value out of range, no chat template, messages the template refuses, an image that cannot be
    fetched, an unknown model: UnknownModel)."""
    params = request_params(body, engine)
    if isinstance(body, ChatRequest):
        tools = body.tool_use()
        if tools is not None and tools.constrained and Constraint.of(params) is not None:
            raise ConstraintError("tools and a response format both constrain the answer: give one, or tool_choice none")
        budget = reasoning_budget if body.reasoning_budget is None else body.reasoning_budget
        prompt = engine.chat_prompt([m.rendered() for m in body.messages], tools, body.chat_template_kwargs, budget)
        params = replace(params, lark=prompt.lark, thinking_budget=prompt.thinking_budget, shown_tokens=prompt.shown_tokens)
        media = tuple(item for m in body.messages for item in m.media(fetch))
        if media:  # the projector reads the rendered text with them
            return EngineInputs([MediaPrompt(prompt.text, media, templated=True)], params, prompt.answer)
        return EngineInputs([prompt.tokens], params, prompt.answer)  # ids: an engine with --chat must not template it again
    if isinstance(body, CompletionRequest) and body.suffix is not None:
        if body.echo:
            raise PromptError("echo and suffix: the prompt of a gap to fill is laid out with the model's FIM tokens, give one")
        limit = params.max_tokens if body.token_limit() is not None else 0
        return EngineInputs([engine.infill_prompt(Infill(prefix, body.suffix), limit) for prefix in body.prompts()], params)
    if isinstance(body, CompletionRequest):
        return EngineInputs(body.prompts(), params)
    raise LlamabatchError(f"no prompts in a {type(body).__name__}")


# -- responses ---------------------------------------------------------------------------


def prompt_progress(progress: PromptProgress) -> dict:
    """llama-server's prompt_progress: prompt tokens in all, taken from a cache, read so far (the
    cached ones included), and milliseconds since the prompt's reading began."""
    return {"total": progress.total, "cache": progress.cached, "processed": progress.processed, "time_ms": round(1000 * progress.seconds, 3)}


def usage(results: Seq[Result]) -> dict:
    """OpenAI's usage: each prompt counted once (its first sample's), and of its tokens those
    whose memory came from a cache rather than being decoded (prompt_tokens_details.cached_tokens)."""
    firsts = [r for r in results if r.sample == 0]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}}


def choice_index(choice: Ticket | Result) -> int:
    """A completion choice's index: prompts in order, each prompt's n samples together."""
    return choice.index * choice.params.n + choice.sample


def completion_choices(results: Seq[Result], vocab: Vocab, shown: Shown) -> list[dict]:
    choices = []
    for r in results:
        choice = {"index": choice_index(r), "text": (r.prompt if shown.echo else "") + r.text,
                  "logprobs": completion_logprobs(r, r.logprobs, vocab, r.prompt_logprobs if shown.echo else None),
                  "finish_reason": r.finish_reason}
        if shown.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(r.prompt_logprobs, vocab, shown.prompt_logprobs)
        choices.append(choice)
    return sorted(choices, key=lambda c: c["index"])


def chat_choices(results: Seq[Result], vocab: Vocab, answer: Answer | None = None) -> list[dict]:
    choices = []
    for r in results:
        message = (answer or Answer()).message(r.text)
        choices.append({"index": r.sample, "message": message, "logprobs": chat_logprobs(r.logprobs, r, vocab),
                        "finish_reason": Answer.finish_reason(r.finish_reason, "tool_calls" in message)})
    return choices


def new_id(kind: str) -> str:
    """A fresh response id: chatcmpl-... for chat, cmpl-... for completions."""
    return f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{secrets.token_hex(12)}"


@dataclass(frozen=True)
class Failure:
    """Why a request has no answer, as the server answers it and a batch job records it."""

    status: int  # 400: it asks what cannot run; 500: the engine failed it; 499: it was cancelled
    message: str


def failure(results: Seq[Result]) -> Failure | None:
    """The one verdict on a request's sequences: the first failure among those that have
    ended, or None when every one has ended well ("stop" or "length"). A request fails whole:
    an answer with a missing or broken choice would read as a success."""
    several = any(r.index > 0 for r in results)
    for r in results:
        if r.finish_reason in ("stop", "length"):
            continue
        where = f"prompt {r.index}: " if several else ""
        if r.finish_reason == "cancelled":
            return Failure(499, f"{where}cancelled before it finished")
        return Failure(400 if r.refused else 500, where + (r.error or f"finished with {r.finish_reason!r}"))
    return None


_ERROR_TYPES = {401: "authentication_error", 429: "rate_limit_error"}


def error_body(status: int, message: str, kind: str | None = None) -> dict:
    """OpenAI's error object, as the server answers a failed request."""
    kind = kind or _ERROR_TYPES.get(status) or ("server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def response_body(
    kind: str, id: str, created: int, model: str, results: Seq[Result], vocab: Vocab, shown: Shown = Shown(),
    answer: Answer | None = None,
) -> dict:
    """The whole answer to a request whose sequences all ended well (failure() is None): a
    text_completion or chat.completion object."""
    if kind == "chat.completion":
        body = {"id": id, "object": kind, "created": created, "model": model, "choices": chat_choices(results, vocab, answer)}
        if shown.prompt_logprobs is not None:  # vLLM puts a chat's prompt log-probabilities beside its choices
            body["prompt_logprobs"] = prompt_logprobs(results[0].prompt_logprobs, vocab, shown.prompt_logprobs)
    else:
        body = {"id": id, "object": kind, "created": created, "model": model,
                "choices": completion_choices(results, vocab, shown)}
    return {**body, "usage": usage(results)}


def completion_logprobs(
    choice: Ticket | Result, generated: Seq[TokenLogprob], vocab: Vocab, echoed: Seq[TokenLogprob] | None = None,
) -> dict | None:
    """OpenAI's legacy completions format: parallel lists per token. With echo (`echoed`: the
    prompt's scored tokens) the prompt's tokens come first, the first of them without a
    log-probability (nothing comes before it)."""
    k = choice.params.logprobs
    if k is None:
        return None
    rows = [(lp.token, lp.logprob, lp.top) for lp in generated]
    if echoed is not None:
        prompt = [(choice.prompt_token_ids[0], None, None)] + [(lp.token, lp.logprob, lp.top[:k]) for lp in echoed]
        rows = prompt + rows
    return {
        "tokens": [piece(vocab, token) for token, _, _ in rows],
        "token_logprobs": [logprob for _, logprob, _ in rows],
        "top_logprobs": [None if top is None else {piece(vocab, t): v for t, v in top} for _, _, top in rows],
    }


def prompt_logprobs(scored: Seq[TokenLogprob], vocab: Vocab, k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: null for the first prompt token, then for each the token itself and
    its k most likely alternatives, keyed by token id, each with its log-probability and rank."""
    entries: list[dict | None] = [None]
    for lp in scored:
        entry = {str(lp.token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": piece(vocab, lp.token)}}
        for rank, (t, v) in enumerate(lp.top[:k], 1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": piece(vocab, t)})
        entries.append(entry)
    return entries


def chat_logprobs(logprobs: Seq[TokenLogprob], choice: Ticket | Result, vocab: Vocab) -> dict | None:
    """OpenAI's chat format: one entry per token, with its alternatives."""
    if choice.params.logprobs is None:
        return None

    def entry(token: int, logprob: float) -> dict:
        return {"token": piece(vocab, token), "logprob": logprob, "bytes": list(vocab.piece(token))}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]}


def piece(vocab: Vocab, token: int) -> str:
    return vocab.piece(token).decode(errors="replace")
