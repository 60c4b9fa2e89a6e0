"""What the engine hands back: per-token events, per-prompt results, run statistics."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sampling.params import SamplingParams


@dataclass(slots=True)
class Event:
    """One step's news for one sequence: a sampled token and its text, or the end. (Not frozen:
    a frozen dataclass costs five times as much to build, and the engine builds one per token.)"""

    index: int  # the prompt's position in the caller's input
    token: int | None  # None for an event that carries only the end (or an error)
    text: str  # newly shown text; may be empty (half a UTF-8 character, a possible stop prefix)
    finish_reason: str | None = None  # "stop", "length", "error" or "cancelled" on the last event
    error: str | None = None
    sample: int = 0  # which of the prompt's n samples
    uid: int = -1  # the sequence's engine-wide id (indices repeat across submit calls)
    logprob: TokenLogprob | None = None  # with SamplingParams.logprobs
    progress: PromptProgress | None = None  # with SamplingParams.prompt_progress: an event of its own (no token) per prompt chunk read
    # A sequence's first event (token or end) when its prompt was scored: the scores, as Result has them.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    result: Result | None = None  # on the last event (finish_reason set): the sequence as it ended


@dataclass(frozen=True)
class PromptProgress:
    """How far a prompt has been read, after a step that read a chunk of it (llama-server's
    prompt_progress: total, cache, processed, time_ms)."""

    total: int  # prompt tokens
    cached: int  # of them, taken from a cache (not read)
    processed: int  # read so far, the cached ones included
    seconds: float  # since the sequence took its slot


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (raw logits, before temperature and
    truncation), and the most likely tokens at that position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, logprob), most likely first
    rank: int = 1  # 1 + how many tokens were more likely


@dataclass
class PromptScore:
    """Log-probabilities of a sequence's prompt tokens from its score_from on, summed as the
    prompt is decoded (each token given the ones before it)."""

    logprob: float = 0.0
    n_tokens: int = 0
    greedy: bool = True  # every scored token was (one of) the most likely at its position
    tokens: list[TokenLogprob] = field(default_factory=list)  # each, with alternatives, when asked for

    @property
    def perplexity(self) -> float:
        return math.exp(-self.logprob / self.n_tokens) if self.n_tokens else math.nan


@dataclass(frozen=True)
class Score:
    """What BatchEngine.score gives for one text or (context, continuation) pair."""

    index: int
    logprob: float  # summed log-probability of the scored tokens (the continuation, or the text)
    n_tokens: int  # tokens scored
    greedy: bool  # every scored token was (one of) the most likely: greedy decoding would give it
    error: str | None = None

    @property
    def perplexity(self) -> float:
        return math.exp(-self.logprob / self.n_tokens) if self.n_tokens else math.nan

    def to_dict(self) -> dict:
        return {**asdict(self), "perplexity": self.perplexity}


@dataclass(frozen=True)
class Timings:
    queue_s: float  # submitted -> given a slot
    ttft_s: float  # submitted -> first token sampled
    decode_s: float  # first token -> finished


@dataclass(frozen=True)
class Ticket:
    """What a caller on another thread may keep of a queued sequence: who it is and what it was
    asked (the Sequence itself is the engine thread's; it hands a Result back at the end)."""

    uid: int
    index: int
    sample: int
    prompt: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class Result:
    """A sequence as it ended, for any thread. to_dict() gives its summary (what `run --json`
    prints of it); the server's answers are made of the rest too."""

    index: int
    sample: int  # 0..n_samples-1
    n_samples: int
    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", "error" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens not decoded: their memory came from a cache (OpenAI's cached_tokens)
    timings: Timings | None  # None when the prompt was rejected
    error: str | None
    uid: int
    refused: bool  # the error is the caller's (it asked what cannot run), not the engine's
    incomplete: bool  # constrained, and cut before its constraint was complete
    stop_word: str | None  # the stop string that ended it (Anthropic's stop_sequence)
    logprobs: tuple[TokenLogprob, ...]  # one per generated token, when asked for
    prompt_logprobs: tuple[TokenLogprob, ...]  # its prompt's scored tokens, when scored
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams

    def to_dict(self) -> dict:
        data = {name: getattr(self, name) for name in _SUMMARY}
        data["timings"] = self.timings and asdict(self.timings)
        return data


_SUMMARY = ("index", "sample", "n_samples", "prompt", "text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens",
            "cached_tokens", "timings", "error")


@dataclass
class RunStats:
    """Counters over the engine's steps since it was created or last reset."""

    prompt_tokens_evaluated: int = 0
    completion_tokens: int = 0
    decode_calls: int = 0  # every llama_decode call, including any that found the KV cache full
    sequence_slots: int = 0  # sum over decode calls of the sequences in the batch
    preemptions: int = 0  # sequences sent back to the queue because the KV cache was full
    priority_preemptions: int = 0  # sequences that made way for a better priority (KV swapped out where it fit)
    failed_steps: int = 0  # steps that decoded nothing, failing the sequences they carried
    failed_decodes: int = 0  # llama_decode calls that failed (not for a full KV cache): retried in halves
    incomplete_structured: int = 0  # constrained outputs cut (max_tokens, context) before their constraint was complete
    prompt_tokens_reused: int = 0  # prompt tokens whose KV came from another sequence or a slot's cache
    draft_tokens: int = 0  # speculative tokens verified
    draft_accepted: int = 0  # of which the model agreed with
    adapter_switches: int = 0  # steps that decoded another LoRA adapter set than the step before
    media_read: int = 0  # images decoded into a sequence's memory (each its own llama_decode, beside the step)
    decodes_ahead: int = 0  # plain steps decoded before the step before them was accepted (overlap)
    first_step_at: float | None = None
    last_step_at: float | None = None

    def reset(self) -> None:
        """Back to zero, in place: the engine's parts all count into this one object."""
        self.__dict__.update(RunStats().__dict__)

    def record_step(self, started: float, ended: float) -> None:
        if self.first_step_at is None:
            self.first_step_at = started
        self.last_step_at = ended

    @property
    def wall_s(self) -> float:
        if self.first_step_at is None or self.last_step_at is None:
            return 0.0
        return self.last_step_at - self.first_step_at

    @property
    def mean_active_sequences(self) -> float:
        return self.sequence_slots / self.decode_calls if self.decode_calls else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.draft_accepted / self.draft_tokens if self.draft_tokens else 0.0

    def summary(self) -> dict:
        return {
            "prompt_tokens_evaluated": self.prompt_tokens_evaluated,
            "prompt_tokens_reused": self.prompt_tokens_reused,
            "completion_tokens": self.completion_tokens,
            "decode_calls": self.decode_calls,
            "mean_active_sequences": round(self.mean_active_sequences, 3),
            "preemptions": self.preemptions,
            "priority_preemptions": self.priority_preemptions,
            "failed_steps": self.failed_steps,
            "failed_decodes": self.failed_decodes,
            "incomplete_structured": self.incomplete_structured,
            "draft_tokens": self.draft_tokens,
            "adapter_switches": self.adapter_switches,
            "media_read": self.media_read,
            "decodes_ahead": self.decodes_ahead,
            "draft_acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_decode": round(self.completion_tokens / self.decode_calls, 3) if self.decode_calls else 0.0,
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
        }
