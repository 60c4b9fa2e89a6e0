"""Deterministic mode's fillers: a throwaway token beside a decode row that would sit alone in
its micro-batch, so that its arithmetic is what it would be beside others."""

from __future__ import annotations

from dataclasses import dataclass

from ..sequence import Sequence
from ..step import Step
from .slots import SlotPool

# ggml-cpu's flash attention takes a split-KV path (different summation order) for a micro-batch
# of one query row in one KV stream once the stream's view (padded to 256 cells) reaches 512
# cells, i.e. once a sequence holds more than 256. In deterministic mode such a row gets a filler.
# (With float weights every lone row does: llamafile's sgemm serves only 2 rows or more.)
LONE_ROW_MAX_CELLS = 256


@dataclass(frozen=True)
class Filler:
    """A throwaway token decoded in another KV stream beside a sequence that would otherwise be
    alone in its micro-batch; its cell is removed right after the decode."""

    seq_id: int
    pos: int


def fillers(step: Step, running: list[Sequence], slots: SlotPool, n_streams: int, lone_row_max_cells: int) -> list[Filler]:
    """A filler beside each one-token row whose sequence holds more than lone_row_max_cells cells
    with it and has no neighbouring seq_id in the batch. llama.cpp groups only consecutive
    seq_ids into one micro-batch, so the filler takes a neighbouring id that is not decoding, at
    that stream's next position."""
    taken = {seq.seq_id for seq in step.rows}
    found = []
    for seq, n in zip(step.rows, step.chunks):
        k = seq.seq_id
        if n != 1 or seq.n_past < lone_row_max_cells or k - 1 in taken or k + 1 in taken:
            continue
        j = k + 1 if k + 1 < n_streams else k - 1
        taken.add(j)
        found.append(Filler(j, _next_position(j, running, slots)))
    return found


def _next_position(seq_id: int, running: list[Sequence], slots: SlotPool) -> int:
    """Where a stream's next token goes: after its running sequence's or free slot's KV."""
    for seq in running:
        if seq.seq_id == seq_id:
            return seq.n_past
    slot = slots.free_slot(seq_id)
    return len(slot.cached) if slot is not None else 0  # a stream beyond the slots is always empty
