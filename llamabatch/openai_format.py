"""OpenAI's API shapes, shared by the server and batch jobs: request bodies (pydantic), what
the engine runs for one, and the completion / chat.completion objects built from its finished
sequences. One place, so a batch job's output body is exactly what the server answers."""

from __future__ import annotations

import secrets
from collections.abc import Sequence as Seq

from pydantic import BaseModel, Field, ValidationError

from .engine import BatchEngine, SamplingParams, Sequence
from .engine.native import Vocab
from .errors import LlamabatchError, PromptError


class SamplingFields(BaseModel):
    """OpenAI's sampling fields (their defaults), plus llama.cpp's top_k and min_p."""

    model: str | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    ignore_eos: bool = False

    def params(self) -> SamplingParams:
        """The engine's SamplingParams; raises SamplingError naming a value out of range."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        fields = self.model_dump(exclude={"model", "stop"} | set(self._extra_fields()))
        return SamplingParams(**fields, stop=tuple(stop), logprobs=self.logprob_count())

    def logprob_count(self) -> int | None:
        return None

    def _extra_fields(self) -> set[str]:
        return set(type(self).model_fields) - set(SamplingFields.model_fields)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool = False
    logprobs: int | None = None  # the sampled token's log-probability and this many alternatives

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """OpenAI's prompt: a string, a list of strings, a list of token ids, or a list of those."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise PromptError("prompt: must not be empty")
        return list(prompt)


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None

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
    where = ".".join(str(p) for p in first["loc"] if p != "body")
    return f"{where}: {first['msg']}" if where else first["msg"]


def engine_inputs(body: SamplingFields, engine: BatchEngine) -> tuple[list[str | list[int]], SamplingParams]:
    """The prompts and sampling parameters the engine runs for a request body. Raises a
    LlamabatchError naming the problem (empty prompt, value out of range, no chat template)."""
    params = body.params()
    if isinstance(body, ChatRequest):
        messages = [m.model_dump() for m in body.messages]
        return [engine.model.apply_chat_template(messages, engine.chat_template)], params
    if isinstance(body, CompletionRequest):
        return body.prompts(), params
    raise LlamabatchError(f"no prompts in a {type(body).__name__}")


# -- responses ---------------------------------------------------------------------------


def usage(sequences: Seq[Sequence]) -> dict:
    prompt = sum(s.n_prompt for s in sequences if s.sample == 0)
    completion = sum(s.n_generated for s in sequences)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def choice_index(seq: Sequence) -> int:
    """A completion choice's index: prompts in order, each prompt's n samples together."""
    return seq.index * seq.params.n + seq.sample


def completion_choices(sequences: Seq[Sequence], vocab: Vocab) -> list[dict]:
    choices = [
        {"index": choice_index(s), "text": s.text.text, "logprobs": completion_logprobs(s.logprobs, s, vocab),
         "finish_reason": finish_reason(s.finish_reason)}
        for s in sequences
    ]
    return sorted(choices, key=lambda c: c["index"])


def chat_choices(sequences: Seq[Sequence], vocab: Vocab) -> list[dict]:
    return [
        {"index": s.sample, "message": {"role": "assistant", "content": s.text.text},
         "logprobs": chat_logprobs(s.logprobs, s, vocab), "finish_reason": finish_reason(s.finish_reason)}
        for s in sequences
    ]


def new_id(kind: str) -> str:
    """A fresh response id: chatcmpl-... for chat, cmpl-... for completions."""
    return f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{secrets.token_hex(12)}"


def error_body(status: int, message: str, kind: str | None = None) -> dict:
    """OpenAI's error object, as the server answers a failed request."""
    kind = kind or {401: "authentication_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def response_body(kind: str, id: str, created: int, model: str, sequences: Seq[Sequence], vocab: Vocab) -> dict:
    """The whole answer to a finished request: a text_completion or chat.completion object."""
    choices = chat_choices(sequences, vocab) if kind == "chat.completion" else completion_choices(sequences, vocab)
    return {"id": id, "object": kind, "created": created, "model": model, "choices": choices, "usage": usage(sequences)}


def completion_logprobs(logprobs: list, seq: Sequence, vocab: Vocab) -> dict | None:
    """OpenAI's legacy completions format: parallel lists per token."""
    if seq.params.logprobs is None:
        return None
    return {
        "tokens": [piece(vocab, lp.token) for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{piece(vocab, t): v for t, v in lp.top} for lp in logprobs],
    }


def chat_logprobs(logprobs: list, seq: Sequence, vocab: Vocab) -> dict | None:
    """OpenAI's chat format: one entry per token, with its alternatives."""
    if seq.params.logprobs is None:
        return None

    def entry(token: int, logprob: float) -> dict:
        return {"token": piece(vocab, token), "logprob": logprob, "bytes": list(vocab.piece(token))}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]}


def finish_reason(reason: str | None) -> str | None:
    """OpenAI knows 'stop' and 'length'; a cancelled or failed sequence reads as 'stop'."""
    return reason if reason in (None, "stop", "length") else "stop"


def piece(vocab: Vocab, token: int) -> str:
    return vocab.piece(token).decode(errors="replace")
