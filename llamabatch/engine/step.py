"""A step: what one llama_decode carries, as the scheduler composed it for the stepper."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .sequence import Sequence


@dataclass(frozen=True, eq=False, slots=True)
class Step:
    """The sequences of one decode and how many tokens each brings: its newest sampled token, or
    a chunk of its prompt (a drafting row brings its drafts after that token besides). Rows are
    in seq_id order: llama.cpp puts only consecutive seq_ids in one micro-batch."""

    rows: list[Sequence] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # tokens rows[k] brings, drafts aside
    # Every row decodes the token it sampled last: one token and one logits row each, row k of
    # the output is rows[k]'s, and nothing is scored, drafted or handed on.
    plain: bool = False
    draws: bool = True  # some running sequence draws its token (else greedy rows take one argmax)
    special: bool = True  # some running sequence is sampled otherwise than by its sampler alone
    checkpoints: frozenset[int] = frozenset()  # uids of the rows whose chunk ends at a checkpoint
    n_decoding: int = 0  # rows that bring one token to decode (the streams this step is a gap of)
    n_prompt: int = 0  # prompt tokens the other rows bring

    def of(self, rows: list[Sequence]) -> Step:
        """The same step for some of its rows (a decode tried again without the one that failed);
        never plain: a row whose memory was put back may have prompt to decode again."""
        chunk = {id(seq): n for seq, n in zip(self.rows, self.chunks)}
        return replace(self, rows=rows, chunks=[chunk[id(seq)] for seq in rows], plain=False, n_decoding=0, n_prompt=0)
