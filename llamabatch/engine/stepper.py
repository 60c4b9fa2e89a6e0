"""The stepper: every step decodes all scheduled sequences with one llama_decode call."""

from __future__ import annotations

import re
import time

import numpy as np

from ..errors import DecodeError, EngineBroken
from .config import EngineConfig
from .memory import MemoryRefused
from .native import INVALID_BATCH, KV_FULL
from .picker import Picker
from .postprocess import Postprocessor
from .results import Event, RunStats
from .rows import lay_out, lay_out_decodes
from .runtime import Runtime
from .sampling import score_rows, token_logprob
from .scheduler import Filler, Scheduler
from .sequence import Sequence, Status
from .slot_cache import SlotCache

# A step that decodes nothing fails the sequences it carried; this many in a row (different
# batches each time) mean the context itself is broken, and the engine stops.
MAX_FAILED_STEPS = 3


class Stepper:
    """schedule → one batch → one decode → sample → postprocess, and the recovery when a decode
    fails: a full KV cache makes room, a sequence that fails a decode fails alone."""

    def __init__(self, config: EngineConfig, runtime: Runtime, scheduler: Scheduler, slots: SlotCache,
                 picker: Picker, post: Postprocessor, stats: RunStats) -> None:
        self.config, self.scheduler, self.slots, self.picker, self.post, self.stats = config, scheduler, slots, picker, post, stats
        self.ctx, self.batch, self.memory = runtime.ctx, runtime.batch, runtime.memory
        self.adapters, self.speculator, self.vocab = runtime.adapters, runtime.speculator, runtime.vocab
        # Float weights go through llamafile's sgemm from 2 rows and ggml's vec_dot for 1, which
        # round differently: a deterministic filler asks for logits too, so the output layer never
        # multiplies a single row either (scheduler.fillers).
        self.filler_logits = runtime.model.float_weights
        self.broken: str | None = None  # why the engine cannot go on, once it cannot
        self._failed_steps = 0  # in a row
        self._output_row: dict[int, int] = {}  # batch row → its row of this step's logits

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
        started = time.perf_counter()
        for victim in self.scheduler.victims():
            self._make_way(victim)
        for seq in self.scheduler.admit():
            self.slots.resume(seq)
        drafted = self._propose_drafts() if self.speculator is not None else None  # None: nothing planned
        scheduled = self.scheduler.schedule(reserved=sum(len(s.draft) for s in drafted) if drafted else 0)
        carried += scheduled
        for seq in drafted or ():
            seq.n_chunk += len(seq.draft)  # its last token, then the drafts
            self.memory.prepare_to_reject(seq.seq_id, len(seq.draft))
        if not scheduled:
            return None
        if self.adapters.apply(self.ctx, scheduled[0].adapters):  # the scheduler gives a step one set
            self.stats.adapter_switches += 1
        tokens_before = self.stats.completion_tokens
        decoded, failure = self._run(scheduled, events)
        ended = time.perf_counter()
        if decoded:
            self.stats.record_step(started, ended)
        if drafted is not None and failure is None:  # planned, so a pure decode step (the speculator plans none beside a prompt)
            self.speculator.observe(drafted, self.stats.completion_tokens - tokens_before, ended - started)
        return failure if not decoded else None

    def _run(self, rows: list[Sequence], events: list[Event]) -> tuple[int, str | None]:
        """Decode the rows in one batch, then advance and sample them. A full KV cache is
        recovered from; any other failed decode is tried again in halves, down to the sequence it
        fails for, which fails alone with llama.cpp's reason: the others decode as they would have.
        Returns how many rows were decoded, and the last failure (None: none)."""
        try:
            self._decode(rows)
        except DecodeError as e:
            if e.code == KV_FULL:
                events += self._recover_kv_full(rows)
                return 0, None
            return self._retry_without(rows, e, events)
        logits = self.ctx.output_logits(self.batch.n_outputs, self.vocab.n_vocab) if self.batch.n_outputs else None
        if self.scheduler.decodes_only:  # the plain step: each row took its token in and samples the next
            for seq in rows:
                seq.n_past += 1
            self._sample(rows, range(len(rows)), logits, events)
            return len(rows), None
        due: list[Sequence] = []
        for seq in rows:
            self._advance(seq, due, logits)
        if due:
            self._sample(due, [self._output_row[s.i_batch] for s in due], logits, events)
        return len(rows), None

    def _retry_without(self, rows: list[Sequence], error: DecodeError, events: list[Event]) -> tuple[int, str | None]:
        """A decode that failed, not for a full cache: the sequence llama.cpp names (or a lone
        row) fails and the rest decode again; else each half is tried on its own."""
        self._undo(rows, stored=error.code != INVALID_BATCH)
        self.stats.failed_decodes += 1
        named = self._named_by(error)
        if named is not None or len(rows) == 1:
            events.append(self.post.fail(named or rows[0], str(error)))
            rest = [seq for seq in rows if seq.status is Status.RUNNING]
            decoded, _ = self._run(rest, events) if rest else (0, None)
            return decoded, str(error)
        decoded, failure = 0, None
        for part in (rows[: len(rows) // 2], rows[len(rows) // 2 :]):
            part = [seq for seq in part if seq.status is Status.RUNNING]  # a half may have preempted some
            n, why = self._run(part, events) if part else (0, None)
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
        for seq in rows:
            if seq.draft:
                seq.n_chunk -= len(seq.draft)
                seq.draft = []
            if stored:
                seq.n_past = self.memory.truncate(seq.seq_id, seq.n_past)

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
        victim.draft = []
        self.scheduler.preempt(victim, kv_full=False)
        self.stats.priority_preemptions += 1

    def _decode(self, scheduled: list[Sequence]) -> None:
        """One batch of the scheduled sequences' chunks (and deterministic fillers), one decode."""
        fillers = self.scheduler.fillers(scheduled) if self.config.deterministic else []
        for filler in fillers:
            self.memory.prepare_to_reject(filler.seq_id, 1)
        if self.scheduler.decodes_only:  # one token and one logits row each, row k for scheduled[k]
            self.batch.set(*lay_out_decodes(scheduled))
        else:
            # Rows in seq_id order: llama.cpp groups consecutive seq_ids into one micro-batch.
            rows = sorted([*scheduled, *fillers], key=lambda row: row.seq_id) if fillers else scheduled  # already in order
            tokens, pos, seq_ids, logits, self._output_row = lay_out(rows, self.filler_logits)
            self.batch.set(tokens, pos, seq_ids, logits)
        self.stats.decode_calls += 1
        self.stats.sequence_slots += len(scheduled)
        try:
            self.ctx.decode(self.batch)
        except DecodeError as e:
            if e.code not in (KV_FULL, INVALID_BATCH):  # refused whole, it stored nothing
                self._take_out(fillers)
            raise
        self._take_out(fillers)

    def _take_out(self, fillers: list[Filler]) -> None:
        """Each filler's stream goes back to what it held: its owner is a prompt between chunks or
        a slot's cached prefix, which the filler must not change."""
        for filler in fillers:
            if self.memory.reject(filler.seq_id, filler.pos, decoded=1) != filler.pos:
                raise MemoryRefused(f"a deterministic filler could not be taken out of sequence {filler.seq_id}'s memory")

    def _advance(self, seq: Sequence, due: list[Sequence], logits: np.ndarray | None) -> None:
        """The decode took the chunk into the KV cache: score the prompt tokens it predicts, hand
        the prefix to followers that wait for exactly this much of it; each sequence now due a
        token joins `due` (followers first)."""
        self.stats.prompt_tokens_evaluated += max(0, min(seq.n_chunk, seq.n_prompt - seq.n_past))
        scored = seq.scored_rows(seq.n_past, seq.n_chunk)
        if scored:
            first = self._output_row[seq.chunk_row + scored.start - seq.n_past]
            targets = seq.tokens[scored.start + 1 : scored.stop + 1]
            score_rows(seq.scored, logits[first : first + len(scored)], targets, seq.params.prompt_logprobs)
        seq.n_past += seq.n_chunk
        if seq.checkpoint_after:
            seq.checkpoint_after = False
            self.memory.checkpoint(seq.seq_id)
        if seq.followers:
            for follower in [f for f in seq.followers if f.n_shared == seq.n_past]:
                self._share_prefix(seq, follower, due)
        if seq.i_batch >= 0:
            due.append(seq)

    def _share_prefix(self, leader: Sequence, follower: Sequence, due: list[Sequence]) -> None:
        self.stats.prompt_tokens_reused += self.memory.share(leader, follower)
        leader.followers.remove(follower)
        follower.leader = None
        if follower.n_past == follower.n_shared and follower.n_pending == 0:  # the whole prompt is shared: sample from the leader's logits
            follower.i_batch = leader.i_batch
            due.append(follower)
        # The follower may have jumped past what its own followers wait for: they copy from it now.
        for waiting in [f for f in follower.followers if f.n_shared <= follower.n_past]:
            self._share_prefix(follower, waiting, due)

    def _sample(self, due: list[Sequence], rows: list[int] | range, logits: np.ndarray, events: list[Event]) -> None:
        """Each due sequence's pick (rows[k] is due[k]'s row of the logits) accepted, drafts
        verified; a sequence that asked for no tokens (max_tokens 0: its prompt was only scored)
        ends here. Each event joins `events` as it happens; a failure is its sequence's alone."""
        accept, add = self.post.accept, events.append  # bound once: the loop runs for every sequence
        picks = self.picker.pick(due, rows, logits, self.scheduler.n_sampled > 0, self.scheduler.n_special > 0)
        for seq, pick in zip(due, picks):
            try:
                if type(pick) is int:
                    add(accept(seq, pick))
                elif pick is not None:
                    raise pick
                elif seq.draft:
                    events += self._verify(seq, logits)
                else:
                    events.append(self.post.finish(seq, None, "", "length"))
            except Exception as e:  # noqa: BLE001 - its failure, not its neighbours'
                if seq.status is not Status.FINISHED:
                    events.append(self.post.fail(seq, f"sampling failed: {type(e).__name__}: {e}"))

    def _verify(self, seq: Sequence, logits: np.ndarray) -> list[Event]:
        """Accept what the speculator keeps of the sequence's drafts (their rejected KV is
        forgotten), one token at a time, so EOS, stop strings and max_tokens cut the run exactly
        where a step each would have."""
        k = len(seq.draft)
        first = self._output_row[seq.chunk_row]
        picks, n_ok = self.speculator.verify(seq, logits[first : first + k + 1], self.picker.scratch)
        seq.draft = []
        seq.n_past -= k - n_ok  # the decode took all k + 1 tokens in; the rejected ones go
        if n_ok < k:
            # Recurrent memory may go back further, to its checkpoint: the kept tokens are decoded again.
            seq.n_past = self.memory.reject(seq.seq_id, seq.n_past, decoded=k + 1)
        self.stats.draft_tokens += k
        self.stats.draft_accepted += n_ok
        events = []
        for j, token in enumerate(picks):
            if seq.params.logprobs is not None:
                seq.logprobs.append(token_logprob(logits[first + j], token, seq.params.logprobs))
            events.append(self.post.accept(seq, token))
            if events[-1].finish_reason is not None:
                break
        return events

    def _recover_kv_full(self, scheduled: list[Sequence]) -> list[Event]:
        """No KV slot for this batch: undo it, then make room by dropping cached prefixes,
        preempting the newest sequence, or (alone) cutting it short."""
        self._undo(scheduled, stored=False)
        if self.ctx.kv_unified and self.scheduler.has_cached_prefixes:  # cells the batch can use: retry
            self.slots.keep_free_slots()
            self.slots.drop_cached_prefixes()
            return []
        if len(self.scheduler.running) > 1:
            victim = max(self.scheduler.running, key=self.scheduler.rank_of)  # the worst ranked: the newest of the lowest priority
            self.memory.clear(victim.seq_id)
            self.scheduler.preempt(victim)
            self.stats.preemptions += 1
            return []
        return [self.post.fail(self.scheduler.running[0], "KV cache full: the sequence does not fit even alone")]
