"""The engine's side of speculative decoding: which sequences draft how many tokens this step,
and how many of a sequence's drafts the step's logits keep. The policy (how long a draft, when
drafting pays) is planner.DraftPlanner's; the drafts themselves come from a Drafter."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import EngineConfig
from .drafters import DraftModel, Drafter, NgramDrafter
from ..native.handles import Vocab
from ..sequence import Sequence
from .planner import DraftPlanner
from .rejection import DraftSampler
from ..sampling.truncation import Scratch

# CPU matrix kernels take a batch's rows four at a time, and the rest by a slower path: with
# Gemma 3 270M Q4_K_M on this project's CPU, one decode of 7 rows took 61 ms and of 8 rows 43 ms
# (16: 60 ms, 17: 76 ms; docs, "Speculative decoding"). Drafts are lengthened to fill the tile.
ROW_TILE = 4


class Speculator:
    """Owns the drafter (and a draft model's context) and the planner of one engine."""

    def __init__(self, drafter: Drafter, draft_max: int) -> None:
        self.drafter = drafter
        self.planner = DraftPlanner(draft_max)

    @classmethod
    def for_config(cls, cfg: EngineConfig, vocab: Vocab, n_ctx: int, draft_path: Path | None) -> Speculator | None:
        """The speculator cfg asks for (None: speculation off)."""
        if cfg.speculative == "ngram":
            return cls(NgramDrafter(vocab.n_vocab), cfg.draft_max)
        if cfg.speculative == "draft":
            drafter = DraftModel(draft_path, vocab, n_ctx=n_ctx, n_batch=cfg.n_batch, n_seq_max=cfg.n_parallel,
                                 n_threads=cfg.n_threads, gpu_layers=cfg.gpu_layers)
            return cls(drafter, cfg.draft_max)
        return None

    def propose(self, generating: list[Sequence], room: int, n_ctx_seq: int) -> list[Sequence] | None:
        """Drafts for generating sequences that can verify them (greedy, or sampled without
        penalties; not constrained), as the planner allows and `room` (rows and logits the batch
        has beside the decode rows) holds: the sequences that got one (None when there was
        nothing to plan)."""
        # Not beside a prompt: its rows make the step long anyway, and would hide what drafting
        # costs from the planner (and a draft model's cost from it altogether). A sequence that
        # decodes again the tokens its memory lost to a rejection (recurrent memory, back at its
        # checkpoint) is no prompt: it skips drafting for that step, the others draft.
        if any(s.n_past < s.n_prompt or s.leader is not None for s in generating):
            return None
        if any(s.adapters != generating[0].adapters for s in generating):
            return None  # the step will decode one adapter set's sequences: drafts only when all share one
        eligible = [s for s in generating if s.n_pending == 1 and s.matcher is None and s.thought is None
                    and (s.sampler.greedy or s.params.verifiable)]
        if not eligible:
            return None
        for seq in eligible:
            if seq.drafting is None:
                seq.drafting = self.planner.state()
        grants = self.planner.plan(len(generating), [s.drafting for s in eligible])
        lengths, caps = [], []
        for seq, k in zip(eligible, grants):
            # The bonus token after the drafts must fit max_tokens and the context too.
            cap = max(0, min(self.planner.draft_max, room, seq.params.max_tokens - seq.n_generated - 1,
                             n_ctx_seq - len(seq.tokens) - 1))
            lengths.append(min(k, cap))
            caps.append(cap)
            room -= lengths[-1]
        if not any(lengths):
            return []
        round_up_to_tile(lengths, caps, len(generating), room)
        for seq, draft in zip(eligible, self.drafter.propose(eligible, lengths)):
            seq.propose(draft)
        return [seq for seq in eligible if seq.draft]

    def verify(self, seq: Sequence, rows: np.ndarray, scratch: Scratch) -> tuple[list[int], int]:
        """The tokens a sequence keeps from its drafts, whose logits are `rows` (its last token's
        row, then one per draft): the drafts up to the first the model refuses, then the model's
        own token there (greedy: those its rows' argmax agrees with; sampled: by rejection
        sampling, DraftSampler). Returns them and how many drafts were kept."""
        draft = seq.draft
        k = len(draft)
        if seq.sampler.greedy:
            picks = rows.argmax(axis=1).tolist()
            n_ok = 0
            while n_ok < k and picks[n_ok] == draft[n_ok]:
                n_ok += 1
            picks = picks[: n_ok + 1]
        else:
            if seq.draft_sampler is None:
                seq.draft_sampler = DraftSampler(seq.params, seq.sampler.rng)  # sampled: a RowSampler
            picks, n_ok = seq.draft_sampler.verify(rows, draft, scratch)
        self.planner.record(seq.drafting, k, n_ok)  # acceptance rates, which plan the next drafts
        return picks, n_ok

    def observe(self, drafted: list[Sequence], tokens: int, seconds: float) -> None:
        """A planned step's outcome (with or without drafts), which decides when drafting pays."""
        setup = self.drafter.prefill_seconds if drafted else 0.0
        self.planner.observe(bool(drafted), tokens, seconds, setup)

    def close(self) -> None:
        self.drafter.close()


def round_up_to_tile(lengths: list[int], caps: list[int], n_rows: int, room: int) -> None:
    """Lengthen drafts (one token at a time, in turn, within each cap and the batch's room) until
    the step's decode rows are a multiple of ROW_TILE: on a CPU those rows cost no more than
    fewer rows (often less), on a GPU next to nothing. Never shortened: a draft's tokens are
    worth more than the rows they save wherever rows are cheap."""
    extra = min(room, -(n_rows + sum(lengths)) % ROW_TILE)
    while extra:
        growing = [i for i, k in enumerate(lengths) if 0 < k < caps[i]]
        if not growing:
            return
        for i in growing[:extra]:
            lengths[i] += 1
        extra -= len(growing[:extra])
