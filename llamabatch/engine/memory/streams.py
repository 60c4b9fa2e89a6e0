"""What each sequence's memory holds in the llama.cpp context, and the one place that changes it.

llama.cpp keeps a sequence's context in one of four kinds of memory, which differ in what can be
undone (docs/guides/model-families.md):

- attention (a KV cache): a cell per position; any tail can be removed, any prefix copied.
- sliding window: the same, but the windowed layers keep only the last n_swa positions, so a
  prefix stays reusable only while the window has not moved past it.
- recurrent (Mamba, RWKV): one state per sequence, the sum of every token so far. llama.cpp refuses
  to remove a tail (but the last few tokens of a decode, on architectures that keep rollback
  snapshots), and a copy copies the whole state whatever range is asked.
- hybrid (attention layers beside recurrent ones: Qwen3.5, LFM2, Granite 4 hybrid, Nemotron-H):
  cut as its recurrent part allows.

Where a cut is refused, a sequence goes back to a checkpoint: a copy of the part of its memory that
cutting cannot restore (the recurrent state; llama.cpp's PARTIAL_ONLY), taken when it held exactly
n positions. Restoring it puts that part back at n, after which the attention part can be cut at
n too. With no checkpoint at or before the position asked for, the sequence is cleared and prefills
again: memory never holds positions the engine does not know of, so no decode meets a broken one.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from ...errors import LlamabatchError
from ..media import Grid, cells_through, position, whole
from ..native.handles import Context, Model
from ..sequence import Sequence

# Host memory for the memory of sequences preempted to make way for a better priority: kept, it
# is put back as it was (no prefill again, and greedy output exactly as unpreempted); beyond this
# budget a preempted sequence's memory is freed and recomputed when it runs again.
SWAP_BUDGET_BYTES = 2 << 30


class Family(Enum):
    ATTENTION = "attention"
    SLIDING_WINDOW = "sliding-window"
    RECURRENT = "recurrent"
    HYBRID = "hybrid"


class MemoryRefused(LlamabatchError):
    """llama.cpp refused an operation that cannot be refused (removing a whole sequence)."""


@dataclass(frozen=True)
class Capabilities:
    """What a context's memory can do, read once from its model and context."""

    family: Family
    n_swa: int = 0  # the sliding window, in positions (0: none)
    rollback: int = 0  # llama.cpp's recurrent rollback snapshots per sequence (n_rs_seq): 0 where none

    @classmethod
    def of(cls, model: Model, ctx: Context) -> Capabilities:
        if model.is_recurrent:
            family = Family.RECURRENT
        elif model.is_hybrid:
            family = Family.HYBRID
        else:
            family = Family.SLIDING_WINDOW if ctx.n_swa else Family.ATTENTION
        return cls(family, ctx.n_swa, ctx.n_rs_seq)

    @property
    def can_cut(self) -> bool:
        """Any tail of a sequence can be removed (checkpoints are needed where it cannot)."""
        return self.family in (Family.ATTENTION, Family.SLIDING_WINDOW)


@dataclass(frozen=True, eq=False)  # one checkpoint is the same one wherever it is kept
class Checkpoint:
    n_tokens: int  # the positions it covers: 0 .. n_tokens - 1
    data: bytes  # llama_state_seq_get_data_ext(PARTIAL_ONLY) when the sequence held exactly those


class Checkpoints:
    """Each stream's checkpoints (sorted by position), within a byte budget over all streams. Over
    budget, the one whose loss leaves the smallest gap in its stream goes first (never a stream's
    newest, which a continuing conversation needs); then the newest of the least recently used
    stream. A copied prefix shares its source's checkpoints (their bytes are counted once). A
    transient checkpoint (one per stream: before speculative drafts, or a deterministic filler)
    is outside the budget and lives until the next one replaces it."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.kept: dict[int, list[Checkpoint]] = {}
        self.transient: dict[int, Checkpoint] = {}
        self.kept_bytes = 0  # of distinct checkpoints
        self._holders: dict[int, int] = {}  # id(checkpoint) -> how many streams keep it
        self._used: dict[int, int] = {}  # stream -> when it last gained or gave back a checkpoint
        self._clock = itertools.count()

    @property
    def bytes(self) -> int:
        return self.kept_bytes + sum(len(cp.data) for cp in self.transient.values())

    @property
    def count(self) -> int:
        return sum(len(kept) for kept in self.kept.values())

    def add(self, seq_id: int, checkpoint: Checkpoint, transient: bool = False) -> None:
        if transient:
            self.transient[seq_id] = checkpoint
            return
        if len(checkpoint.data) > self.budget:
            return
        kept = self.kept.setdefault(seq_id, [])
        for old in [cp for cp in kept if cp.n_tokens == checkpoint.n_tokens]:  # replaced
            self._drop(seq_id, old)
        self._keep(seq_id, checkpoint)
        kept.sort(key=lambda cp: cp.n_tokens)
        self._used[seq_id] = next(self._clock)
        while self.kept_bytes > self.budget:
            self._evict_one()

    def best(self, seq_id: int, n: int) -> Checkpoint | None:
        """The latest checkpoint of the stream at or before position n."""
        candidates = [cp for cp in [*self.kept.get(seq_id, ()), self.transient.get(seq_id)] if cp and cp.n_tokens <= n]
        if candidates:
            self._used[seq_id] = next(self._clock)
        return max(candidates, key=lambda cp: cp.n_tokens, default=None)

    def of(self, seq_id: int) -> list[Checkpoint]:
        return self.kept.get(seq_id, [])

    def adopt(self, seq_id: int, checkpoints: Iterable[Checkpoint], held: int) -> None:
        """The stream was given a kept state of `held` positions: these checkpoints describe it."""
        self.drop(seq_id)
        self.kept[seq_id] = []
        for cp in checkpoints:
            if cp.n_tokens <= held:
                self._keep(seq_id, cp)
        self.kept[seq_id].sort(key=lambda cp: cp.n_tokens)
        self._used[seq_id] = next(self._clock)
        while self.kept_bytes > self.budget:
            self._evict_one()

    def has(self, seq_id: int, n: int) -> bool:
        return any(cp.n_tokens == n for cp in self.kept.get(seq_id, ()))

    def drop_after(self, seq_id: int, n: int) -> None:
        """The stream's positions from n on changed: checkpoints beyond n no longer describe it."""
        for cp in [cp for cp in self.kept.get(seq_id, ()) if cp.n_tokens > n]:
            self._drop(seq_id, cp)
        transient = self.transient.get(seq_id)
        if transient is not None and transient.n_tokens > n:
            del self.transient[seq_id]

    def drop(self, seq_id: int) -> None:
        self.drop_after(seq_id, -1)
        self.kept.pop(seq_id, None)
        self._used.pop(seq_id, None)

    def inherit(self, src: int, dst: int, n: int) -> None:
        """dst now holds src's first n positions: src's checkpoints up to n describe dst too."""
        self.drop(dst)
        self.kept[dst] = []
        for cp in self.kept.get(src, ()):
            if cp.n_tokens <= n:
                self._keep(dst, cp)
        self._used[dst] = next(self._clock)

    def _keep(self, seq_id: int, cp: Checkpoint) -> None:
        self.kept[seq_id].append(cp)
        self._holders[id(cp)] = self._holders.get(id(cp), 0) + 1
        if self._holders[id(cp)] == 1:
            self.kept_bytes += len(cp.data)

    def _drop(self, seq_id: int, cp: Checkpoint) -> None:
        self.kept[seq_id].remove(cp)
        self._holders[id(cp)] -= 1
        if not self._holders[id(cp)]:
            del self._holders[id(cp)]
            self.kept_bytes -= len(cp.data)

    def _evict_one(self) -> None:
        victim: tuple[int, Checkpoint] | None = None
        smallest_gap = None
        for seq_id, kept in self.kept.items():
            for i, cp in enumerate(kept[:-1]):
                gap = kept[i + 1].n_tokens - (kept[i - 1].n_tokens if i else 0)
                if smallest_gap is None or gap < smallest_gap:
                    victim, smallest_gap = (seq_id, cp), gap
        if victim is None:  # each stream keeps one: the least recently used stream's goes
            seq_id = min((s for s, kept in self.kept.items() if kept), key=lambda s: self._used.get(s, -1))
            victim = seq_id, self.kept[seq_id][-1]
        self._drop(*victim)


class Memory:
    """The sequences' memory in one context, and every change made to it.

    Callers say what they want a stream (a seq_id) to hold: its first n tokens (its first n
    positions, except past an M-RoPE image: grids), a copy of another's prefix. The answer is
    what it holds now, which may be less: the tokens after it must be decoded again. A refusal
    by llama.cpp is never ignored. The sequence-level operations (resume, share, swap_out) keep
    each Sequence's n_past in step with its stream."""

    def __init__(self, ctx: Context, model: Model, checkpoint_budget: int) -> None:
        self.ctx = ctx
        self.caps = Capabilities.of(model, ctx)
        self.checkpoints = Checkpoints(checkpoint_budget)
        self.swapped_bytes = 0  # memory of preempted sequences held in host memory
        self.restored = 0  # checkpoints put back (prefix reuse, rejected drafts)
        self.rolled_back = 0  # rejected tokens undone through llama.cpp's snapshots
        # The M-RoPE images of streams holding some (their cells outnumber their positions): what
        # they hold and where they are cut is counted in tokens through them (media.position).
        self.grids: dict[int, Grid] = {}

    @property
    def checkpointing(self) -> bool:
        """Prompts are checkpointed as they prefill: the memory cannot always be cut (recurrent
        state; a sliding window that moved past the cut), and has a budget for them."""
        return self.caps.family is not Family.ATTENTION and self.checkpoints.budget > 0

    # -- sequences ------------------------------------------------------------------------

    def resume(self, seq: Sequence) -> None:
        """A sequence just admitted to its slot: a preempted one gets the memory it had swapped out
        (or starts over, if it no longer fits); any other keeps what the memory allows of the
        prefix the scheduler matched in the slot's cache (seq.n_past): all of it, or up to a
        checkpoint. Where the prompt parts from the cached one, a checkpoint will be taken. Its
        stream counts positions as it does already (place)."""
        if seq.swapped is not None:
            held = self.restore(seq.seq_id, seq.swapped)
            self.drop_swap(seq)
            if held == seq.n_past:
                return
            self.clear(seq.seq_id)
            seq.restart()
        matched, held = seq.n_past, self.held(seq.seq_id)
        kept = self.truncate(seq.seq_id, matched)
        seq.hold(kept, cached=min(kept, seq.n_prompt))
        if self.checkpointing and 0 < matched < held:  # where prompts part ways: later ones alike come back here
            if kept == matched:
                self.checkpoint(seq.seq_id)  # (the cut worked: the window still reached, or a checkpoint was there)
            else:
                seq.checkpoint_at = matched  # its prefill stops here for one

    def place(self, seq_id: int, grid: Grid) -> None:
        """The stream counts positions through these M-RoPE images from now on (none: one a
        token): its sequence's, or a cached state's it was given. What it held before agrees with
        them up to where their tokens part, the only part kept."""
        if grid:
            self.grids[seq_id] = grid
        else:
            self.grids.pop(seq_id, None)

    def reusable(self, seq_id: int, n: int) -> int:
        """How many of the stream's first n positions truncate() would keep (nothing is changed)."""
        return self._keeps(n, self.held(seq_id), self.ctx.seq_pos_min(seq_id), [cp.n_tokens for cp in self.checkpoints.of(seq_id)])

    def reusable_from(self, n: int, held: int, positions: Iterable[int]) -> int:
        """The same for a kept state of `held` positions (prompt_cache.CachedPrompt) with
        checkpoints at `positions`, once put back. llama.cpp puts back only the last n_swa
        positions of a sliding window: a state longer than the window cuts only at a checkpoint."""
        return self._keeps(n, held, max(0, held - self.caps.n_swa), positions)

    def _keeps(self, n: int, held: int, pos_min: int, positions: Iterable[int]) -> int:
        if n >= held:
            return held
        if n <= 0:
            return 0
        if self.caps.family is Family.ATTENTION or (self.caps.family is Family.SLIDING_WINDOW and self._reaches(pos_min, n)):
            return n
        return max((p for p in positions if p <= n), default=0)

    def snapshot(self, seq_id: int) -> tuple[bytes, tuple[Checkpoint, ...], Grid]:
        """What the stream holds, to keep outside the context: its whole state, its checkpoints
        (shared, not copied) and its M-RoPE images."""
        return self.ctx.state(seq_id), tuple(self.checkpoints.of(seq_id)), self.grids.get(seq_id, ())

    def put_back(self, seq_id: int, state: bytes, checkpoints: Iterable[Checkpoint], grid: Grid) -> int:
        """A snapshot into the stream, replacing what it held; returns the tokens it holds now
        (0: llama.cpp did not take it)."""
        self.place(seq_id, grid)
        held = self.restore(seq_id, state)
        if held:
            self.checkpoints.adopt(seq_id, checkpoints, held)
        return held

    def share(self, leader: Sequence, follower: Sequence) -> int:
        """The follower gets the leader's first follower.n_shared positions (or as many as the
        memory gives: recurrent state is copied whole, exact only when the leader holds exactly
        those). Returns the prompt tokens it gained."""
        got = self.copy(leader.seq_id, follower.seq_id, follower.n_shared)
        gained = max(0, min(got, follower.n_prompt) - follower.n_cached)
        follower.hold(got, cached=min(got, follower.n_prompt))
        return gained

    def swap_out(self, seq: Sequence) -> None:
        """A preempted sequence's memory, to host memory where SWAP_BUDGET_BYTES holds it (resume
        puts it back), then freed."""
        if seq.n_past and self.swapped_bytes < SWAP_BUDGET_BYTES:
            saved = self.save(seq.seq_id)
            if self.swapped_bytes + len(saved) <= SWAP_BUDGET_BYTES:
                seq.swapped = saved
                self.swapped_bytes += len(saved)
        self.clear(seq.seq_id)

    def drop_swap(self, seq: Sequence) -> None:
        if seq.swapped is not None:
            self.swapped_bytes -= len(seq.swapped)
            seq.swapped = None

    # -- streams --------------------------------------------------------------------------

    def held(self, seq_id: int) -> int:
        """Tokens the stream holds (its first `held`)."""
        last = self.ctx.seq_pos_max(seq_id)
        grid = self.grids.get(seq_id)
        return last + 1 if grid is None else cells_through(grid, last)

    def _remove_from(self, seq_id: int, n: int) -> bool:
        """llama.cpp removes the stream's tokens from n on (False: it refused)."""
        return self.ctx.seq_rm(seq_id, self._position(seq_id, n))

    def _position(self, seq_id: int, n: int) -> int:
        """Where the stream's token n sits: n, unless it holds M-RoPE images (media.position)."""
        grid = self.grids.get(seq_id)
        return n if grid is None else position(grid, n)

    def clear(self, seq_id: int) -> None:
        if not self.ctx.seq_rm(seq_id):
            raise MemoryRefused(f"llama.cpp refused to free sequence {seq_id}'s memory")
        self.checkpoints.drop(seq_id)

    def truncate(self, seq_id: int, n: int) -> int:
        """Keep the stream's first n positions, or as many as a checkpoint allows (then fewer,
        maybe none). Returns how many it keeps."""
        held = self.held(seq_id)
        if n >= held:
            return held
        if n <= 0:
            self.clear(seq_id)
            return 0
        if self.caps.can_cut:
            return self._cut(seq_id, n)
        return self._rewind(seq_id, n)

    def reject(self, seq_id: int, n: int, decoded: int) -> int:
        """Undo the last tokens the stream's latest decode brought (`decoded` of them: rejected
        drafts, or a deterministic filler), keeping n positions. Recurrent memory rolls back
        through llama.cpp's snapshots when they reach (they hold only that decode's tokens), else
        through the checkpoint taken before it (prepare_to_reject). Returns the positions kept."""
        held = self.held(seq_id)
        if n >= held:
            return held
        if not self.caps.can_cut and held - n < decoded and held - n <= self.caps.rollback and n > 0:
            if self._remove_from(seq_id, n):
                self.checkpoints.drop_after(seq_id, n)
                self.rolled_back += 1
                return n
        return self.truncate(seq_id, n)

    def prepare_to_reject(self, seq_id: int, n_tokens: int) -> None:
        """Before a decode whose last n_tokens of this stream may be undone: where neither a cut
        nor the snapshots can undo them, a transient checkpoint of what the stream holds now."""
        if self.caps.can_cut or n_tokens <= self.caps.rollback or self.held(seq_id) == 0:
            return
        self.checkpoint(seq_id, transient=True)

    def copy(self, src: int, dst: int, n: int) -> int:
        """Give dst src's first n positions (or fewer: returns how many it got)."""
        self.clear(dst)
        if n <= 0:
            return 0
        if self.ctx.kv_unified:
            n = self._whole(src, n)
            self.ctx.seq_cp(src, dst, 0, self._position(src, n))  # shared cells: only which sequences own them changes
        else:
            self.ctx.seq_cp(src, dst)  # per-sequence buffers are copied whole (llama.cpp copies no part)
        self.checkpoints.inherit(src, dst, n)
        got = self.held(dst)
        if got <= n:  # recurrent state is copied whole: exact when src held exactly n
            return got
        return self._cut(dst, n) if self.caps.can_cut else self._rewind(dst, n)

    def checkpoint(self, seq_id: int, transient: bool = False) -> None:
        """Keep what the stream holds now (its recurrent part) to come back to."""
        n = self.held(seq_id)
        if n == 0 or (not transient and self.checkpoints.has(seq_id, n)):
            return
        data = self.ctx.state(seq_id, partial=True)
        if data:  # llama.cpp wrote nothing: nothing to come back to
            self.checkpoints.add(seq_id, Checkpoint(n, data), transient)

    def save(self, seq_id: int) -> bytes:
        """All of a stream's memory (to swap a preempted sequence out to host memory)."""
        return self.ctx.state(seq_id)

    def restore(self, seq_id: int, data: bytes) -> int:
        """Put a save() back into an empty stream; returns the positions it holds (0: it did not fit)."""
        self.clear(seq_id)
        if self.ctx.set_state(seq_id, data):
            return self.held(seq_id)
        self.clear(seq_id)  # whatever part did go in
        return 0

    def _cut(self, seq_id: int, n: int) -> int:
        if self.caps.family is Family.SLIDING_WINDOW and not self._reaches(self.ctx.seq_pos_min(seq_id), n):
            return self._rewind(seq_id, n)  # the window moved past n: back to a checkpoint of it, if any
        n = self._whole(seq_id, n)
        if not self._remove_from(seq_id, n):
            raise MemoryRefused(f"llama.cpp refused to cut sequence {seq_id} at position {n} ({self.caps.family.value} memory)")
        self.checkpoints.drop_after(seq_id, n)
        return n

    def _whole(self, seq_id: int, n: int) -> int:
        """n, or the start of the M-RoPE image it would cut into (media.whole)."""
        grid = self.grids.get(seq_id)
        return n if grid is None else whole(grid, n)

    def _reaches(self, pos_min: int, n: int) -> bool:
        """Whether windowed layers holding positions from pos_min on hold those a token at n attends to."""
        return 0 <= pos_min <= max(0, n - self.caps.n_swa)

    def _rewind(self, seq_id: int, n: int) -> int:
        """Back to the latest checkpoint at or before n (its recurrent part put back, then the
        attention part cut there), or to nothing."""
        checkpoint = self.checkpoints.best(seq_id, n)
        if checkpoint is not None and self.ctx.set_state(seq_id, checkpoint.data, partial=True):
            if self._remove_from(seq_id, checkpoint.n_tokens) and self.held(seq_id) == checkpoint.n_tokens:
                self.checkpoints.drop_after(seq_id, checkpoint.n_tokens)
                self.restored += 1
                return checkpoint.n_tokens
        self.clear(seq_id)
        return 0
