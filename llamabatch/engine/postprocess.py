"""What a sampled token does to its sequence: appended, checked against every way the sequence
can end, and an end frees the sequence's slot."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .config import EngineConfig
from .memory.streams import Memory
from .native.handles import Vocab
from .results import Event, PromptProgress, RunStats
from .scheduling.scheduler import Scheduler
from .sequence import Sequence, Status


class Postprocessor:
    def __init__(self, config: EngineConfig, vocab: Vocab, memory: Memory, scheduler: Scheduler, stats: RunStats) -> None:
        self.vocab, self.memory, self.scheduler, self.stats = vocab, memory, scheduler, stats
        self.share_prefixes = config.share_prefixes
        # token -> (ends generation, its bytes, its text where the bytes are whole characters): one lookup a token
        self._known: dict[int, tuple[bool, bytes, str | None]] = {}
        self._goes_on: set[int] = set()  # the tokens learned so far that do not end generation: one lookup a plain row whose text is whole
        self._quiet: QuietRows | None = None  # the plain rows answered whole that accept_plain saw last

    def accept(self, seq: Sequence, token: int, events: list[Event]) -> None:
        """Append the sampled token and add its event to `events` (a sequence no one streams has
        only its last: Sequence.streamed); finish the sequence if it ends here (a constrained one
        ends when its constraint is complete)."""
        seq.tokens.append(token)
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            # The mask allowed nothing it would take: the constraint itself broke down (llguidance
            # gave up on it, or it has a dead end), which is the request's to fix, as a schema
            # that does not compile is.
            seq.refused = True
            events.append(self.finish(seq, token, "", "error", f"the constraint cannot be followed: {seq.matcher.get_error()}"))
            return
        self.stats.completion_tokens += 1
        if seq.t_first_token is None:
            seq.t_first_token = time.perf_counter()
        eog, piece, text = self._known.get(token) or self._learn(token)
        if eog and not seq.params.ignore_eos:
            events.append(self.finish(seq, token, "", "stop"))
            return
        if seq.whole_text:  # its text is made at its end
            if len(seq.tokens) >= seq.max_len:
                events.append(self.finish(seq, token, "", "length"))
            return
        if token in seq.params.shown_tokens:
            text = self.vocab.text(token) or ""
            piece = text.encode()
        stream = seq.stream
        text = stream.push(piece, text)
        if seq.thought is not None and not seq.forced:
            seq.forced = seq.thought.after(piece) or []
        limit = seq.params.max_predict_s
        if stream.stopped or (seq.matcher is not None and seq.matcher.is_stopped()):
            events.append(self.finish(seq, token, text, "stop"))
        elif len(seq.tokens) >= seq.max_len or (limit is not None and _out_of_time(seq, piece, limit)):
            events.append(self.finish(seq, token, text, "length"))
        elif seq.streamed:
            events.append(event(seq, token, text))

    def continues(self, seq: Sequence, token: int) -> bool:
        """Whether the sequence goes on after taking `token`, as far as the token itself tells
        (an end of generation, its length): a stop string shows only once its text is read."""
        entry = self._known.get(token) or self._learn(token)
        return (not entry[0] or seq.params.ignore_eos) and len(seq.tokens) + 1 < seq.max_len

    def accept_plain(self, rows: list[Sequence], picks: list, events: list[Event]) -> None:
        """accept() for each row of a plain step none of whose sequences is special (no
        constraint, thought or log-probabilities), its common path inline: this loop runs for
        every token of most steps (an event only where someone reads it, a text only where it is
        watched). Each row has sampled before (its first token came with its prompt's step). A
        pick that is an exception (its sampler failed) fails its row alone.

        Rows all answered whole whose picks all go on, none reaching its length, only append
        them (QuietRows): most steps of generate(), job lines and the sweep."""
        quiet = self._quiet
        if quiet is None or quiet.rows is not rows:
            quiet = self._quiet = QuietRows.of(rows)
        nearest = quiet.nearest_end
        if nearest is not None and len(nearest.tokens) + 1 < nearest.max_len and self._goes_on.issuperset(picks):
            _SINK.extend(map(list.append, quiet.tokens, picks))
            self.stats.completion_tokens += len(picks)
            return
        known, goes_on, add, failed = self._known, self._goes_on, events.append, 0
        for seq, token in zip(rows, picks):
            try:
                if type(token) is not int:
                    failed += 1
                    raise token
                tokens = seq.tokens
                tokens.append(token)
                if token not in goes_on and (known.get(token) or self._learn(token))[0] and not seq.params.ignore_eos:
                    add(self.finish(seq, token, "", "stop"))
                    continue
                if seq.whole_text:  # its text is made at its end
                    if len(tokens) >= seq.max_len:
                        add(self.finish(seq, token, "", "length"))
                    continue
                entry = known.get(token) or self._learn(token)
                stream = seq.stream
                text = stream.push(entry[1], entry[2])
                if stream.stopped:
                    add(self.finish(seq, token, text, "stop"))
                elif len(tokens) >= seq.max_len:
                    add(self.finish(seq, token, text, "length"))
                elif seq.streamed:
                    add(Event(seq.index, token, text, None, None, seq.sample, seq.uid, None))
            except Exception as e:  # noqa: BLE001 - its failure, not its neighbours'
                if seq.status is not Status.FINISHED:
                    add(self.fail(seq, f"sampling failed: {type(e).__name__}: {e}"))
        self.stats.completion_tokens += len(picks) - failed

    def _learn(self, token: int) -> tuple[bool, bytes, str | None]:
        """A token's entry in the table, made the first time the token is sampled."""
        piece = self.vocab.piece(token)
        try:
            text: str | None = piece.decode()
        except UnicodeDecodeError:  # part of a character (or bad bytes): decoded with its neighbours
            text = None
        entry = self._known[token] = (self.vocab.is_eog(token), piece, text)
        if not entry[0]:
            self._goes_on.add(token)
        return entry

    def finish(self, seq: Sequence, token: int | None, text: str, reason: str, error: str | None = None) -> Event:
        """The sequence is done; its KV stays in its slot as a prefix cache for later prompts
        (when prefixes are shared; else it is freed, so a deterministic filler finds room there)."""
        if seq.whole_text:
            text = seq.stream.push(self._shown_bytes(seq, reason))
        text += seq.stream.finish()
        self._quiet = None  # its step's rows change: nothing keeps the sequence
        self.memory.drop_swap(seq)
        seq.end(reason, error)
        if seq.incomplete:
            self.stats.incomplete_structured += 1
        if seq.status is Status.RUNNING and not self.share_prefixes:
            self.memory.clear(seq.seq_id)
        self.scheduler.release(seq)
        seq.close_samplers()
        return event(seq, token, text, reason, error)

    def _shown_bytes(self, seq: Sequence, reason: str) -> bytes:
        """A whole-text sequence's generated bytes, as its stream would have shown them token by
        token: all but the end of generation that stopped it (the only stop it watches)."""
        known, piece = self._known, self.vocab.piece
        return b"".join(known[t][1] if t in known else piece(t) for t in seq.tokens[seq.n_prompt : len(seq.tokens) - (reason == "stop")])

    def fail(self, seq: Sequence, message: str) -> Event:
        """End a sequence with the engine's error. Its KV goes: a failed decode may have left
        part of a batch there."""
        if seq.status is Status.RUNNING:
            self.memory.clear(seq.seq_id)
            seq.hold(0)  # its slot keeps nothing
        seq.drop_draft()
        return self.finish(seq, None, "", "error", message)


@dataclass(frozen=True, slots=True)
class QuietRows:
    """The rows of a plain step (the same list while the scheduler hands the step over again)
    when every one is answered whole: its token lists, and the row nearest its length. They take
    their tokens in step, so while that row's next token does not reach its length, none does:
    a step whose picks end no row then only appends them."""

    rows: list[Sequence]
    tokens: list[list[int]]
    nearest_end: Sequence | None  # None: some row is read as it comes, or its text watched

    @staticmethod
    def of(rows: list[Sequence]) -> QuietRows:
        if not all(seq.whole_text for seq in rows):
            return QuietRows(rows, [], None)
        return QuietRows(rows, [seq.tokens for seq in rows], min(rows, key=lambda seq: seq.max_len - len(seq.tokens), default=None))


_SINK: deque[None] = deque(maxlen=0)  # extend() runs an iterator through (map's calls) without a bytecode a row


def _out_of_time(seq: Sequence, piece: bytes, limit: float) -> bool:
    """A line ended after the sequence's time to generate (max_predict_s) ran out."""
    return b"\n" in piece and time.perf_counter() - (seq.t_first_token or 0.0) > limit


def progress_event(seq: Sequence) -> Event:
    """How far the sequence's prompt has been read (SamplingParams.prompt_progress)."""
    progress = PromptProgress(seq.n_prompt, seq.n_cached, min(seq.n_past, seq.n_prompt), time.perf_counter() - (seq.t_admitted or seq.t_submitted))
    return Event(seq.index, None, "", sample=seq.sample, uid=seq.uid, progress=progress)


def event(seq: Sequence, token: int | None, text: str, reason: str | None = None, error: str | None = None) -> Event:
    """The general path's event; the last one (a reason) carries the sequence's Result, and a scored
    prompt's first one its scores."""
    logprob = seq.logprobs[-1] if token is not None and seq.logprobs else None
    scores = tuple(seq.scored.tokens) if seq.score_from >= 0 and seq.n_generated <= 1 else None
    return Event(seq.index, token, text, reason, error, seq.sample, seq.uid, logprob, None, scores, None if reason is None else seq.result())
