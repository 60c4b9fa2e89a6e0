"""The stepper: every step decodes all scheduled sequences with one llama_decode call."""

from __future__ import annotations

import re
import time

import numpy as np

from ..errors import DecodeError, EngineBroken
from .config import EngineConfig
from .memory.streams import MemoryRefused
from .native.handles import INVALID_BATCH, KV_FULL
from .native.projector import Placed, decode_images
from .rpc import offloads
from .sampling.picker import Picker
from .postprocess import Postprocessor, progress_event
from .results import Event, RunStats
from .rows import Layout, lay_out, lay_out_decodes
from .runtime import Runtime
from .sampling.samplers import score_rows, token_logprob
from .scheduling.fillers import Filler
from .scheduling.scheduler import Scheduler
from .sequence import Sequence, Status
from .memory.reuse import PrefixReuse
from .step import Step

# A step that decodes nothing fails the sequences it carried; this many in a row (different
# batches each time) mean the context itself is broken, and the engine stops.
MAX_FAILED_STEPS = 3


class Stepper:
    """schedule → one batch → one decode → sample → postprocess, and the recovery when a decode
    fails: a full KV cache makes room, a sequence that fails a decode fails alone."""

    def __init__(self, config: EngineConfig, runtime: Runtime, scheduler: Scheduler, reuse: PrefixReuse,
                 picker: Picker, post: Postprocessor, stats: RunStats) -> None:
        self.config, self.scheduler, self.reuse, self.picker, self.post, self.stats = config, scheduler, reuse, picker, post, stats
        self.ctx, self.batch, self.memory = runtime.ctx, runtime.batch, runtime.memory
        self.adapters, self.speculator, self.vocab = runtime.adapters, runtime.speculator, runtime.vocab
        self.media_batch = runtime.media_batch  # None: no projector, no images
        # Float weights go through llamafile's sgemm from 2 rows and ggml's vec_dot for 1, which
        # round differently: a deterministic filler asks for logits too, so the output layer never
        # multiplies a single row either (scheduler.fillers).
        self.filler_logits = runtime.model.float_weights
        self.broken: str | None = None  # why the engine cannot go on, once it cannot
        self._failed_steps = 0  # in a row
        # The plain step the batch holds, and the tokens it sampled: when the scheduler hands it
        # over again, the batch keeps its seq_ids and logits flags and takes only the new tokens.
        self._in_batch: Step | None = None
        self._picked: list[int] = []
        # Overlap (EngineConfig.overlap): the next plain step is decoded while this one's tokens
        # are accepted, and read at the next step. Only where the token decoded past a stop string
        # can be cut off again, and not where drafts or fillers make a step more than its rows.
        self.runs_ahead = runtime.memory.caps.can_cut and self.speculator is None and not config.deterministic and (
            config.overlap == "on" or (config.overlap == "auto" and offloads(config.gpu_layers)))
        self._ahead: Step | None = None  # the step decoded ahead, its logits not read yet
        self._ahead_ids: list[int] = []  # its rows' seq_ids (a sequence that ends gives its own up)

    def step(self) -> list[Event]:
        """Admit, schedule, fill one batch, decode it once, sample each sequence that is due a token.
        A decode that fails because of one sequence fails that sequence alone (_run); anything
        else that fails a step fails the sequences it carried. Once MAX_FAILED_STEPS in a row
        decode nothing, the engine is broken and every later step raises EngineBroken."""
        if self.broken is not None:
            raise EngineBroken(self.broken)
        events: list[Event] = []
        carried: list[Sequence] = []
        try:
            failure = self._step(events, carried)
        except Exception as e:  # noqa: BLE001 - whatever failed, the sequences must end, reported
            events += self._fail_step(carried or list(self.scheduler.running), e)
        else:
            if failure is None:
                self._failed_steps = 0
            else:
                self._count_failed_step(failure)
        return events

    def _step(self, events: list[Event], carried: list[Sequence]) -> str | None:
        """One step; returns why it decoded nothing, when every row it carried failed to decode."""
        if self._ahead is not None:
            self._read_ahead(events, carried)
            return None
        started = time.perf_counter()
        if self.scheduler.waiting:  # (most steps: nothing waits)
            for victim in self.scheduler.victims():
                self._make_way(victim)
            for seq in self.scheduler.admit():
                self.reuse.resume(seq)
        images = self._read_images(events) if self.media_batch is not None else 0
        drafted = self._propose_drafts() if self.speculator is not None else None  # None: nothing planned
        step = self.scheduler.schedule(reserved=sum(len(s.draft) for s in drafted) if drafted else 0, media=images)
        carried += step.rows
        for seq in drafted or ():
            self.memory.prepare_to_reject(seq.seq_id, len(seq.draft))
        if not step.rows:
            return None
        # The scheduler gives a step one set of adapters; a step handed over again keeps the last.
        if step is not self._in_batch and self.adapters.apply(self.ctx, step.rows[0].adapters):
            self.stats.adapter_switches += 1
        tokens_before = self.stats.completion_tokens
        decoded, failure = self._run(step, events)
        ended = time.perf_counter()
        if decoded:
            self.stats.record_step(started, ended)
            if failure is None and not drafted:  # a step as composed: what its rows cost, for the step budget
                self.scheduler.budget.observe(step.n_decoding, step.n_prompt + images, ended - started)  # an image's positions are prompt work
        if drafted is not None and failure is None:  # planned, so a pure decode step (the speculator plans none beside a prompt)
            self.speculator.observe(drafted, self.stats.completion_tokens - tokens_before, ended - started)
        return failure if not decoded else None

    def _run(self, step: Step, events: list[Event]) -> tuple[int, str | None]:
        """Decode the step in one batch, then advance and sample its rows. A full KV cache is
        recovered from; any other failed decode is tried again in halves, down to the sequence it
        fails for, which fails alone with llama.cpp's reason: the others decode as they would have.
        Returns how many rows were decoded, and the last failure (None: none)."""
        try:
            layout = self._decode(step)
        except DecodeError as e:
            self._in_batch = None
            if e.code == KV_FULL:
                events += self._recover_kv_full(step.rows)
                return 0, None
            return self._retry_without(step, e, events)
        logits = self.ctx.output_logits(self.batch.n_outputs, self.vocab.n_vocab) if self.batch.n_outputs else None
        if layout is None:  # the plain step: each row took its token in and samples the next
            Sequence.advance_each(step.rows)
            self._picked = self._sample(step, step.rows, None, logits, events)
            return len(step.rows), None
        due: list[Sequence] = []
        rows: list[int] = []
        for k, (seq, n) in enumerate(zip(step.rows, step.chunks)):
            self._advance(seq, n, seq.uid in step.checkpoints, layout, k, logits, due, rows)
            if seq.params.prompt_progress and seq.n_past <= seq.n_prompt:  # a chunk of its prompt
                events.append(progress_event(seq))
        if due:
            self._sample(step, due, rows, logits, events)
        return len(step.rows), None

    def _retry_without(self, step: Step, error: DecodeError, events: list[Event]) -> tuple[int, str | None]:
        """A decode that failed, not for a full cache: the sequence llama.cpp names (or a lone
        row) fails and the rest decode again; else each half is tried on its own."""
        rows = step.rows
        self._undo(rows, stored=error.code != INVALID_BATCH)
        self.stats.failed_decodes += 1
        named = self._named_by(error)
        if named is not None or len(rows) == 1:
            events.append(self.post.fail(named or rows[0], str(error)))
            rest = [seq for seq in rows if seq.status is Status.RUNNING]
            decoded, _ = self._run(step.of(rest), events) if rest else (0, None)
            return decoded, str(error)
        decoded, failure = 0, None
        for part in (rows[: len(rows) // 2], rows[len(rows) // 2 :]):
            part = [seq for seq in part if seq.status is Status.RUNNING]  # a half may have preempted some
            n, why = self._run(step.of(part), events) if part else (0, None)
            decoded, failure = decoded + n, why or failure
        return decoded, failure

    def _named_by(self, error: DecodeError) -> Sequence | None:
        """The running sequence llama.cpp's refusal names ("the tokens of sequence 3 ..."), if any:
        it fails at once, with no halving (which a filler in its stream would mislead)."""
        found = re.search(r"\bsequence (\d+)\b", str(error))
        return next((seq for seq in self.scheduler.running if found and seq.seq_id == int(found[1])), None)

    def _undo(self, rows: list[Sequence], stored: bool = True) -> None:
        """A decode that did not go through: drafts are dropped (the rows decode their last token),
        and where llama.cpp may have stored part of the batch (`stored`: it failed while
        computing, after some micro-batches), each row's memory goes back to what it held before,
        which recurrent memory may only do to a checkpoint (those rows then prefill from there).
        A batch refused whole (no free KV slot, or invalid) left memory as it was."""
        self.scheduler.recompose()
        for seq in rows:
            seq.drop_draft()
            if stored:
                seq.hold(self.memory.truncate(seq.seq_id, seq.n_past))

    def _count_failed_step(self, why: str) -> None:
        self._failed_steps += 1
        self.stats.failed_steps += 1
        if self._failed_steps >= MAX_FAILED_STEPS:
            self.broken = f"{MAX_FAILED_STEPS} engine steps failed in a row, the last with: {why}"

    def _fail_step(self, carried: list[Sequence], error: Exception) -> list[Event]:
        """End every unfinished sequence the failed step carried with the error (their events
        from before the failure stand), and any follower it gave a prefix to that never got to
        sample from it (nothing left to decode, it would wait forever)."""
        message = f"the engine step failed: {type(error).__name__}: {error}"
        self._count_failed_step(message)
        stranded = [seq for seq in self.scheduler.running if seq.n_pending == 0]
        return [self.post.fail(seq, message) for seq in dict.fromkeys(carried + stranded) if seq.status is not Status.FINISHED]

    def _read_images(self, events: list[Event]) -> int:
        """Each running sequence whose next positions are an image's (or a clip's) has it
        decoded now (a batch holds tokens or embeddings, not both), the images of all such
        sequences together: the step then carries their text after the image beside everyone's
        tokens. Beside streamed decoding sequences, with the step budget on, a step reads at most
        the budget's prompt tokens of image positions (an image attended one way in parts, one
        attended both ways whole): a large image stalls the streams no more than a prompt does.
        When a decode fails, each image is decoded alone, and one that still fails (no room in
        the KV cache) fails its sequence alone. Returns the positions read."""
        running = self.scheduler.running
        budget = self.scheduler.budget
        streamed = sum(1 for seq in running if seq.n_pending == 1 and seq.streamed)
        left = budget.prompt_tokens(streamed, self.ctx.n_ctx) if budget.on and streamed and not self.config.deterministic else None
        read = 0
        while left is None or left > 0:
            parts = []
            for seq in running:
                span = seq.media_at() if seq.media and seq.leader is None else None
                if span is None:
                    continue
                done = seq.n_past - span.start
                n = span.image.n_tokens - done if left is None or span.image.non_causal else min(span.image.n_tokens - done, left)
                if n > 0:
                    positions = span.image.positions(seq.position(span.start))[:, done : done + n]
                    parts.append((seq, span, Placed(span.image.embeddings[done : done + n], span.image.non_causal, seq.seq_id, seq.n_past, positions)))
                    left = None if left is None else left - n
            if not parts:
                break
            try:
                decode_images(self.ctx, self.media_batch, [placed for _, _, placed in parts])
            except DecodeError:
                self._undo([seq for seq, _, _ in parts])
                parts = [(seq, span, placed) for seq, span, placed in parts if self._read_alone(seq, placed, events)]
            for seq, span, placed in parts:
                seq.advance(len(placed.rows))
                read += len(placed.rows)
                self.stats.prompt_tokens_evaluated += len(placed.rows)
                if seq.n_past == span.end:
                    self.stats.media_read += 1
                for follower in seq.followers_due():
                    self._share_prefix(seq, follower, -1, [], [])
        return read

    def _read_alone(self, seq: Sequence, placed: Placed, events: list[Event]) -> bool:
        """One image's part decoded on its own; False when it fails (its sequence ends with why)."""
        if seq.n_past != placed.first:  # memory put back to a checkpoint before it: read from there
            return False
        try:
            decode_images(self.ctx, self.media_batch, [placed])
        except DecodeError as e:
            self._undo([seq])
            events.append(self.post.fail(seq, f"reading its image: {e}"))
            return False
        return True

    def _propose_drafts(self) -> list[Sequence] | None:
        """Drafts where the speculator plans them; their rows must fit the batch beside every
        decode row, their logits the logits budget."""
        running = self.scheduler.running
        room = min(self.ctx.n_batch, self.scheduler.max_outputs) - len(running)
        return self.speculator.propose(running, room, self.ctx.n_ctx_seq)

    def _make_way(self, victim: Sequence) -> None:
        """Preempt a running sequence for a better-priority one: its memory swapped out to host
        memory where the budget holds it (put back when it runs again), else freed."""
        self.memory.swap_out(victim)
        victim.drop_draft()
        self.scheduler.preempt(victim, kv_full=False)
        self.stats.priority_preemptions += 1

    def _decode(self, step: Step) -> Layout | None:
        """One batch of the step's chunks (and deterministic fillers), one decode; where its rows
        landed (None for a plain step: row k is rows[k]'s, every row with logits)."""
        fillers = self.scheduler.fillers(step) if self.config.deterministic else []
        for filler in fillers:
            self.memory.prepare_to_reject(filler.seq_id, 1)
        layout = None
        if not step.plain:
            columns, layout = lay_out(step, fillers, self.filler_logits)
            self.batch.set(columns.tokens, columns.pos, columns.seq_ids, columns.logits)
        elif step is self._in_batch:  # the same rows as the last step: only their new tokens
            self.batch.set_next(self._picked)
        else:
            self.batch.set(*lay_out_decodes(step))
        self._in_batch = step if step.plain else None
        self.stats.decode_calls += 1
        self.stats.sequence_slots += len(step.rows)
        try:
            self.ctx.decode(self.batch)
        except DecodeError as e:
            if e.code not in (KV_FULL, INVALID_BATCH):  # refused whole, it stored nothing
                self._take_out(fillers)
            raise
        if fillers:
            self._take_out(fillers)
        return layout

    def _take_out(self, fillers: list[Filler]) -> None:
        """Each filler's stream goes back to what it held: its owner is a prompt between chunks or
        a slot's cached prefix, which the filler must not change."""
        for filler in fillers:
            if self.memory.reject(filler.seq_id, filler.pos, decoded=1) != filler.pos:
                raise MemoryRefused(f"a deterministic filler could not be taken out of sequence {filler.seq_id}'s memory")

    def _advance(self, seq: Sequence, n: int, checkpoint: bool, layout: Layout, k: int, logits: np.ndarray | None,
                 due: list[Sequence], rows: list[int]) -> None:
        """The decode took rows[k]'s chunk of n tokens (and its drafts) into memory: score the
        prompt tokens it predicts, checkpoint where the scheduler said, hand the prefix to
        followers that wait for exactly this much of it; each sequence now due a token joins `due`
        (followers first), with its row of the logits in `rows`."""
        self.stats.prompt_tokens_evaluated += max(0, min(n, seq.n_prompt - seq.n_past))
        scored = seq.scored_rows(seq.n_past, n)
        if scored:
            first = layout.output_row[layout.first[k] + scored.start - seq.n_past]
            targets = seq.tokens[scored.start + 1 : scored.stop + 1]
            score_rows(seq.scored, logits[first : first + len(scored)], targets, seq.params.prompt_logprobs)
        seq.advance(n + len(seq.draft))
        if checkpoint:
            self.memory.checkpoint(seq.seq_id)
        row = layout.sampled[k]
        if seq.followers:
            for follower in seq.followers_due():
                self._share_prefix(seq, follower, row, due, rows)
        if row >= 0:
            due.append(seq)
            rows.append(row)

    def _share_prefix(self, leader: Sequence, follower: Sequence, row: int, due: list[Sequence], rows: list[int]) -> None:
        """The follower gets the leader's prefix copied; one whose whole prompt that is samples
        from the leader's row of the logits (`row`)."""
        self.stats.prompt_tokens_reused += self.memory.share(leader, follower)
        follower.unfollow()
        if follower.n_past == follower.n_shared and follower.n_pending == 0 and row >= 0:
            due.append(follower)
            rows.append(row)
        # The follower may have jumped past what its own followers wait for: they copy from it now.
        for waiting in [f for f in follower.followers if f.n_shared <= follower.n_past]:
            self._share_prefix(follower, waiting, row, due, rows)

    def _sample(self, step: Step, due: list[Sequence], rows: list[int] | None, logits: np.ndarray, events: list[Event]) -> list:
        """Each due sequence's pick (rows[k] is due[k]'s row of the logits; None: row k) accepted, drafts
        verified; a sequence that asked for no tokens (max_tokens 0: its prompt was only scored)
        ends here. Each event joins `events` as it happens; a failure is its sequence's alone.
        Returns the picks."""
        picks = self.picker.pick(due, rows, logits, step.draws, step.special)
        if step.plain and not step.special:  # every row plain: one token each, no drafts, nothing special
            ahead = self.runs_ahead and self._decode_ahead(step, due, picks)
            self.post.accept_plain(due, picks, events)
            if ahead:
                self._cut_past_ends()
            return picks
        accept = self.post.accept  # bound once: the loop runs for every sequence
        for seq, pick, row in zip(due, picks, range(len(due)) if rows is None else rows):
            try:
                if type(pick) is int:
                    accept(seq, pick, events)
                elif pick is not None:
                    raise pick
                elif seq.draft:
                    events += self._verify(seq, logits, row - len(seq.draft))
                else:
                    events.append(self.post.finish(seq, None, "", "length"))
            except Exception as e:  # noqa: BLE001 - its failure, not its neighbours'
                if seq.status is not Status.FINISHED:
                    events.append(self.post.fail(seq, f"sampling failed: {type(e).__name__}: {e}"))
        return picks

    def _decode_ahead(self, step: Step, due: list[Sequence], picks: list) -> bool:
        """Decode the step after this plain one now, before its picks are accepted, where the
        scheduler would hand the same rows over again: every row picked a token that, as far as
        the token tells, does not end it, and nothing waits to be admitted. A decode that fails
        is undone, and the next step is decoded in the plain order, which recovers from it."""
        if len(due) != len(step.rows) or self._in_batch is not step or self.scheduler.waiting or not self.scheduler.repeats(step):
            return False
        continues = self.post.continues
        for seq, pick in zip(due, picks):
            if type(pick) is not int or not continues(seq, pick):
                return False
        self.batch.set_next(picks)
        self.stats.decode_calls += 1
        self.stats.sequence_slots += len(due)
        try:
            self.ctx.decode(self.batch)
        except DecodeError as e:
            self._in_batch = None
            self._undo(due, stored=e.code not in (KV_FULL, INVALID_BATCH))
            return False
        self.stats.decodes_ahead += 1
        self._ahead, self._ahead_ids = step, [seq.seq_id for seq in due]
        return True

    def _read_ahead(self, events: list[Event], carried: list[Sequence]) -> None:
        """The step decoded ahead: its rows still running take their token in and sample the next
        (deciding again whether to decode ahead); a row that ended since has its token cut off."""
        started = time.perf_counter()
        step = self._ahead
        if not self._cut_past_ends():
            return
        if self._in_batch is step:  # every row still runs
            rows, indices = step.rows, None
        else:
            indices = [k for k, seq in enumerate(step.rows) if seq.status is Status.RUNNING]
            rows = [step.rows[k] for k in indices]
        carried += rows
        logits = self.ctx.output_logits(self.batch.n_outputs, self.vocab.n_vocab)  # waits for the device
        self._ahead = None
        Sequence.advance_each(rows)
        self._picked = self._sample(step, rows, indices, logits, events)
        self.stats.record_step(started, time.perf_counter())

    def _cut_past_ends(self) -> bool:
        """Rows of the step decoded ahead that ended since it was decoded (a stop string, a
        cancel) lose the token decoded past their end; the batch no longer holds the scheduler's
        step then. Returns whether any row still runs (else nothing is left to read)."""
        step = self._ahead
        ended = 0
        for seq, seq_id in zip(step.rows, self._ahead_ids):
            if seq.status is not Status.RUNNING:
                self.memory.truncate(seq_id, seq.n_past)
                ended += 1
        if not ended:
            return True
        self._in_batch = None
        if ended == len(step.rows):
            self._ahead = None
            return False
        return True

    def _verify(self, seq: Sequence, logits: np.ndarray, first: int) -> list[Event]:
        """Accept what the speculator keeps of the sequence's drafts (their rejected KV is
        forgotten), one token at a time, so EOS, stop strings and max_tokens cut the run exactly
        where a step each would have. Its logits rows start at `first` (its last token's)."""
        k = len(seq.draft)
        picks, n_ok = self.speculator.verify(seq, logits[first : first + k + 1], self.picker.scratch)
        seq.drop_draft()
        kept = seq.n_past - (k - n_ok)  # the decode took all k + 1 tokens in; the rejected ones go
        # Recurrent memory may go back further, to its checkpoint: the kept tokens are decoded again.
        seq.hold(self.memory.reject(seq.seq_id, kept, decoded=k + 1) if n_ok < k else kept)
        self.stats.draft_tokens += k
        self.stats.draft_accepted += n_ok
        events: list[Event] = []
        for j, token in enumerate(picks):
            if seq.params.logprobs is not None:
                seq.logprobs.append(token_logprob(logits[first + j], token, seq.params.logprobs))
            self.post.accept(seq, token, events)
            if seq.finish_reason is not None:
                break
        return events

    def _recover_kv_full(self, scheduled: list[Sequence]) -> list[Event]:
        """No KV slot for this batch: undo it, then make room by dropping cached prefixes,
        preempting the newest sequence, or (alone) cutting it short."""
        self._undo(scheduled, stored=False)
        if self.ctx.kv_unified and self.scheduler.slots.has_cached:  # cells the batch can use: retry
            self.reuse.keep_free_slots()
            self.reuse.drop_cached_prefixes()
            return []
        if len(self.scheduler.running) > 1:
            victim = max(self.scheduler.running, key=self.scheduler.rank_of)  # the worst ranked: the newest of the lowest priority
            self.memory.clear(victim.seq_id)
            self.scheduler.preempt(victim)
            self.stats.preemptions += 1
            return []
        return [self.post.fail(self.scheduler.running[0], "KV cache full: the sequence does not fit even alone")]
