"""One sequence's whole state: its tokens, its place in the KV cache, its sampler, its text."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from .adapters import BASE, AdapterSet
from .media import Grid, MediaSpan, grid, position
from .sampling.thinking import Thought
from .results import PromptScore, Result, Ticket, Timings, TokenLogprob
from .sampling.samplers import GreedySampler, RowSampler
from .sampling.params import SamplingParams
from .speculative.rejection import DraftSampler
from .speculative.planner import DraftState
from .text import TextStream

if TYPE_CHECKING:
    from .sampling.constraints import Matcher


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two token lists share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


class Status(Enum):
    WAITING = "waiting"  # queued, no slot yet
    RUNNING = "running"  # holds a seq_id and KV cells
    FINISHED = "finished"


@dataclass(eq=False, slots=True)  # slots: the step reads a sequence's fields a dozen times a token
class Sequence:
    index: int  # position in the caller's input
    prompt: str
    params: SamplingParams
    tokens: list[int]  # prompt token ids, then generated ones
    n_prompt: int
    max_len: int = 1 << 62  # its tokens when it must stop ("length"): max_tokens generated, or a full context
    sampler: GreedySampler | RowSampler | None = None
    stream: TextStream = field(init=False)  # its text, shown as it comes
    status: Status = Status.WAITING
    seq_id: int = -1  # llama.cpp sequence id while RUNNING
    # Tokens already in its memory (the KV cache, or a recurrent state). Changed only through the
    # methods below (admit, advance, hold, restart), whoever asks: each names why it moved.
    n_past: int = 0
    n_cached: int = 0  # prompt tokens whose memory came from a cache or another sequence, not decoded
    # Memory that cannot be cut (recurrent, hybrid) is checkpointed where the scheduler ends a
    # prompt chunk; checkpoint_at is one more place to stop: where its prompt parted from a cached one.
    checkpoint_at: int = -1
    sample: int = 0  # which of the prompt's n samples
    uid: int = -1  # unique within its engine
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, if asked for
    # Prompt scoring: prompt tokens from index score_from on get their log-probabilities (-1: none).
    score_from: int = -1
    scored: PromptScore = field(default_factory=PromptScore)
    matcher: Matcher | None = None  # its constraint (structured output), if any
    # Sampled otherwise than by its sampler alone (a constraint, log-probabilities, or no tokens
    # to generate): the engine's general path, which plain rows skip. Set once, when it is added.
    special: bool = False
    thought: Thought | None = None  # a thinking budget's watch over its thought
    forced: list[int] = field(default_factory=list)  # tokens to write next instead of sampling (a thought's close)
    drafting: DraftState | None = None  # speculative decoding: its acceptance rate (and n-gram index)
    draft_sampler: DraftSampler | None = None  # and, when it samples, how they are verified
    draft: list[int] = field(default_factory=list)  # tokens proposed after the last one, this step
    # Prefix sharing: a follower waits (unscheduled) until its leader has n_shared tokens in
    # the KV cache, then gets them copied instead of decoding them itself.
    leader: Sequence | None = None
    n_shared: int = 0
    followers: list[Sequence] = field(default_factory=list)
    # Admission: lower priority values run first (vLLM's convention), aged by waiting time
    # (queue.rank); the class names the entry point, for metrics ("interactive", "batch").
    priority: int = 0
    priority_class: str = "interactive"
    # Its tokens are read as they come: each has an event, and the step budget keeps a step short
    # for it. Else only its end is awaited: its last event is its only one (and its prompt's
    # progress, if asked), and a prompt beside it is read in whole chunks (no one sees its gaps).
    streamed: bool = True
    # Its text is made once, at its end (Postprocessor.finish): no one reads it as it comes (not
    # streamed) and nothing watches it (no stop string, indentation limit or special sampling).
    whole_text: bool = False
    adapters: AdapterSet = BASE  # the LoRA adapters it decodes under (its KV is theirs)
    media: tuple[MediaSpan, ...] = ()  # its prompt's images, in order: their positions are read apart from the step
    # Its M-RoPE images, and the cells they fill beyond their positions: its generated tokens sit
    # `shift` before their index (0 for every other sequence). Set once, from its media.
    grid: Grid = field(init=False)
    shift: int = field(init=False)
    swapped: bytes | None = None  # its KV (n_past positions), saved to host memory while preempted
    finish_reason: str | None = None  # "stop", "length", "error" or "cancelled"
    error: str | None = None
    refused: bool = False  # the error is the caller's (it asked what cannot run), not the engine's
    t_submitted: float = field(default_factory=time.perf_counter)
    t_admitted: float | None = None
    t_first_token: float | None = None
    t_finished: float | None = None

    def __post_init__(self) -> None:
        self.stream = TextStream(self.params.stop, self.params.n_indent)
        self.grid = grid(self.media)
        self.shift = sum(image.lost for image in self.grid)

    # -- the one writer of its status, place in memory, leader, draft and end ----------------

    def admit(self, seq_id: int, n_reusable: int) -> None:
        """It holds a slot now; a sequence that was not swapped out starts from the n_reusable
        leading tokens the slot's cache holds of its prompt (the engine confirms them)."""
        self.seq_id, self.status, self.t_admitted = seq_id, Status.RUNNING, time.perf_counter()
        if self.swapped is None:
            self.n_past = n_reusable

    def advance(self, n: int) -> None:
        """A decode took n more of its tokens into memory."""
        self.n_past += n

    @staticmethod
    def advance_each(rows: list[Sequence]) -> None:
        """A plain step's decode took each row's newest token (advance(1) each, without a call each)."""
        for seq in rows:
            seq.n_past += 1

    def hold(self, n: int, cached: int | None = None) -> None:
        """Its memory holds its first n tokens now (cut back, put back from a checkpoint or a
        cache, or copied from another sequence); `cached`: how many of its prompt tokens came so."""
        self.n_past = n
        if cached is not None:
            self.n_cached = cached

    def restart(self) -> None:
        """Its memory is gone: it prefills (and scores) its prompt again from the start."""
        self.n_past, self.scored = 0, PromptScore()

    def leave(self, status: Status) -> None:
        """It gives its slot back: waiting again (preempted), or finished."""
        self.seq_id, self.status = -1, status

    def follow(self, leader: Sequence, n_shared: int) -> None:
        """It waits, unscheduled, until `leader` holds its first n_shared tokens, to have them copied."""
        self.leader, self.n_shared = leader, n_shared
        leader.followers.append(self)

    def unfollow(self) -> None:
        """It waits for its leader no more: it got the prefix."""
        assert self.leader is not None, "only a follower unfollows"
        self.leader.followers.remove(self)
        self.leader = None

    def part(self) -> None:
        """It leaves the running set: it follows no one, and its followers prefill on their own."""
        if self.leader is not None:
            self.unfollow()
        for follower in self.followers:
            follower.leader = None
        self.followers = []

    def end(self, reason: str, error: str | None = None) -> None:
        """It is done: "stop", "length", "error" (with why) or "cancelled"."""
        self.finish_reason, self.error, self.t_finished = reason, error, time.perf_counter()

    def propose(self, draft: list[int]) -> None:
        """Speculative tokens to verify after its newest one, this step."""
        self.draft = draft

    def drop_draft(self) -> None:
        self.draft = []

    @property
    def text(self) -> str:
        """Its text so far (cut at a stop string)."""
        return self.stream.text

    def position(self, n: int) -> int:
        """Where its token n sits: n, unless an M-RoPE image comes before it (media.position)."""
        return position(self.grid, n) if self.shift else n

    def media_at(self) -> MediaSpan | None:
        """The image (or clip) its next position is in, if it is in one: at its start, or past
        the part of it already read."""
        return next((span for span in self.media if span.start <= self.n_past < span.end), None)

    @property
    def text_ahead(self) -> int:
        """Its pending tokens a step may carry: up to its next image, if one comes (none while
        it is within one)."""
        start = next((span.start for span in self.media if span.end > self.n_past), len(self.tokens))
        return max(0, start - self.n_past)

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def draws(self) -> bool:
        """Its sampler draws its tokens (it is not the step's greedy argmax)."""
        return self.sampler is not None and not self.sampler.greedy

    @property
    def n_pending(self) -> int:
        """Tokens not yet in the KV cache: the rest of the prompt, or the last sampled token."""
        return len(self.tokens) - self.n_past

    @property
    def incomplete(self) -> bool:
        """Constrained, and cut (max_tokens, a full context) before its constraint was complete:
        its text is not the structured output it was asked for."""
        return self.matcher is not None and self.finish_reason == "length"

    @property
    def shareable(self) -> int:
        """Leading tokens whose KV may come from another sequence: all of them, or, when the
        prompt is scored, those before the first scored row (it must be decoded for its logits)."""
        return len(self.tokens) if self.score_from < 0 else max(0, self.score_from - 1)

    def scored_rows(self, start: int, n: int) -> range:
        """Positions among start .. start+n-1 whose logits score a prompt token (the one after)."""
        if self.score_from < 0:
            return range(0)
        return range(max(start, self.score_from - 1), min(start + n, self.n_prompt - 1))

    def followers_due(self) -> list[Sequence]:
        """Its followers that wait for exactly the prefix its memory holds now: they copy it now."""
        return [f for f in self.followers if f.n_shared == self.n_past]

    @property
    def prefix_cap(self) -> int | None:
        """Where this sequence's prefill must pause so followers can copy its prefix."""
        return min((f.n_shared for f in self.followers), default=None)

    def close_samplers(self) -> None:
        """Free the native samplers this sequence owns (safe to call again)."""
        for sampler in (self.sampler, self.draft_sampler):
            if sampler is not None:
                sampler.close()

    def result(self) -> Result:
        timings = None
        if self.t_first_token is not None and self.t_finished is not None:
            timings = Timings(
                queue_s=(self.t_admitted or self.t_submitted) - self.t_submitted,
                ttft_s=self.t_first_token - self.t_submitted,
                decode_s=self.t_finished - self.t_first_token,
            )
        return Result(
            index=self.index,
            sample=self.sample,
            n_samples=self.params.n,
            prompt=self.prompt,
            text=self.text,
            token_ids=self.tokens[self.n_prompt :],
            finish_reason=self.finish_reason or "error",
            prompt_tokens=self.n_prompt,
            completion_tokens=self.n_generated,
            cached_tokens=self.n_cached,
            timings=timings,
            error=self.error,
            uid=self.uid,
            refused=self.refused,
            incomplete=self.incomplete,
            stop_word=self.stream.stop_hit,
            logprobs=tuple(self.logprobs),
            prompt_logprobs=tuple(self.scored.tokens),
            prompt_token_ids=tuple(self.tokens[: self.n_prompt]),
            params=self.params,
        )

    def ticket(self) -> Ticket:
        return Ticket(self.uid, self.index, self.sample, self.prompt, tuple(self.tokens[: self.n_prompt]), self.params)
