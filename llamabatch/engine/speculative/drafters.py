"""Where speculative drafts come from: prompt lookup (each sequence's own n-gram index), or a draft
model, a smaller model with the target's vocabulary that proposes each sequence's next tokens
greedily, every drafting sequence in the same llama_decode, one decode per draft position. The
draft model has a context of its own, whose seq_id i follows the target's slot i.

That context is a cache, reconciled with each sequence's tokens when it next drafts: what
it holds for the slot is kept up to the first token that differs from the sequence's (rejected
drafts, or another sequence that took the slot) and the rest is decoded. So it needs no news of
admissions, preemptions or verifications, and a slot's cached prompt serves its next sequence in
the draft context too. A draft model whose memory cannot be cut (recurrent, hybrid) is
checkpointed before its drafts, and goes back there to drop the rejected ones. Greedy proposals
are deterministic, so rejection sampling that treats each draft as certain
(rejection.DraftSampler) keeps a sampled sequence's distribution exact.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

import llama_cpp

from ...errors import DecodeError, ModelError
from ..memory.streams import Memory
from ..native.handles import KV_FULL, Batch, Context, Model, Vocab
from ..sequence import Sequence, common_prefix

# llama.cpp's own speculative tools accept a draft vocabulary this much larger or smaller than the
# target's (models pad their vocabularies differently); the ids both have must mean the same.
VOCAB_SIZE_SLACK = 128


class Drafter(Protocol):
    """Where drafts come from: up to lengths[i] tokens to follow sequences[i]'s last token."""

    prefill_seconds: float  # of the last propose(), spent on prompts (see DraftModel)

    def propose(self, sequences: list[Sequence], lengths: list[int]) -> list[list[int]]: ...

    def close(self) -> None: ...


class NgramDrafter:
    """Drafts by prompt lookup: no model, no decode. A draft stops before an image's or a clip's
    positions (their ids, media.placeholders, are above the vocabulary: no token to decode)."""

    prefill_seconds = 0.0

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab

    def propose(self, sequences: list[Sequence], lengths: list[int]) -> list[list[int]]:
        return [self._tokens_only(s.drafting.ngrams.propose(s.tokens, k)) if k > 0 else [] for s, k in zip(sequences, lengths)]

    def _tokens_only(self, draft: list[int]) -> list[int]:
        return draft[: next((i for i, t in enumerate(draft) if t >= self.n_vocab), len(draft))]

    def close(self) -> None:
        pass


class DraftModel:
    """Owns the draft model, its context and its batch; close() frees them."""

    def __init__(
        self, path: Path, target: Vocab, *, n_ctx: int, n_batch: int, n_seq_max: int, n_threads: int, gpu_layers: int
    ) -> None:
        self.model = Model(path, gpu_layers)
        try:
            self.model.check_supported()
            check_same_vocabulary(target, self.model.vocab, path.name)
            self.ctx = Context(
                self.model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=n_seq_max,
                n_threads=n_threads, kv_unified=True,
            )
        except Exception:
            self.model.close()
            raise
        self.memory = Memory(self.ctx, self.model, checkpoint_budget=0)  # a transient checkpoint per slot only
        self.batch = Batch(self.ctx.n_batch)
        self.n_vocab = min(target.n_vocab, self.model.vocab.n_vocab)  # drafts only ids the target has
        self.held: dict[int, list[int]] = {}  # seq_id -> the tokens its KV holds, from position 0
        # Of the last propose(), the time spent decoding prompts: once a sequence, as its prefill
        # is in the target, so the planner leaves it out of the rate of steps with drafts (but
        # counts it in what trying them costs).
        self.prefill_seconds = 0.0

    def propose(self, sequences: list[Sequence], lengths: list[int]) -> list[list[int]]:
        """Up to lengths[i] greedy tokens after each sequence's last token. When the draft context
        has no room (KV full), stale slots are dropped and it tries once more; failing again,
        no drafts this step."""
        self.prefill_seconds = 0.0
        drafting = {s.seq_id for s, k in zip(sequences, lengths) if k > 0}
        for attempt in range(2):
            try:
                return self._propose(sequences, lengths)
            except DecodeError as e:
                if e.code != KV_FULL:
                    raise
                for seq_id, held in list(self.held.items()):
                    if seq_id in drafting and not attempt:  # drop what the failed decodes may have stored
                        self.held[seq_id] = held[: self.memory.truncate(seq_id, len(held))]
                    else:
                        self.memory.clear(seq_id)
                        del self.held[seq_id]
        return [[] for _ in sequences]

    def _propose(self, sequences: list[Sequence], lengths: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in sequences]
        todo = [i for i, k in enumerate(lengths) if k > 0]
        # First the tokens the draft context lacks (new prompts apart, then the rest: at least
        # each sequence's last token, whose logits give its first draft token).
        catch_up, prompts = [], []
        for i in todo:
            seq = sequences[i]
            keep = self._reconcile(seq.seq_id, seq.tokens)
            if keep < seq.n_prompt - 1:  # its prompt, decoded apart and timed: see prefill_seconds
                prompts.append((seq.seq_id, seq.tokens[keep : seq.n_prompt - 1], keep))
                keep = seq.n_prompt - 1
            catch_up.append((seq.seq_id, seq.tokens[keep:], keep))
        if prompts:
            started = time.perf_counter()
            self._decode_rows(prompts, logits=False)
            self.prefill_seconds = time.perf_counter() - started
        for i, token in zip(todo, self._decode_rows(catch_up)):
            drafts[i].append(token)
            self.memory.prepare_to_reject(sequences[i].seq_id, lengths[i])
        # Then one decode per further draft position, for the sequences that want it.
        for j in range(1, max((lengths[i] for i in todo), default=0)):
            todo = [i for i in todo if lengths[i] > j]
            rows = [(sequences[i].seq_id, drafts[i][-1:], len(sequences[i].tokens) + j - 1) for i in todo]
            for i, token in zip(todo, self._decode_rows(rows)):
                drafts[i].append(token)
        for seq, draft in zip(sequences, drafts):
            if draft:  # its context now holds every draft token but the last
                self.held[seq.seq_id] = seq.tokens + draft[:-1]
        return drafts

    def _reconcile(self, seq_id: int, tokens: list[int]) -> int:
        """Keep the slot's KV up to where it stops matching `tokens` (and short of the last token,
        which must be decoded for its logits); return how many positions are kept."""
        held = self.held.get(seq_id, [])
        keep = min(common_prefix(held, tokens), len(tokens) - 1)
        if keep < len(held):
            keep = self.memory.truncate(seq_id, keep)  # recurrent memory: back to its checkpoint, or to nothing
        self.held[seq_id] = held[:keep]  # until this step's decodes succeed
        return keep

    def _decode_rows(self, rows: list[tuple[int, list[int], int]], logits: bool = True) -> list[int]:
        """Decode each (seq_id, tokens, first position), as few llama_decode calls as n_batch allows,
        and return the argmax after each one's last token (none without logits)."""
        picks: list[int] = []
        tokens: list[int] = []
        pos: list[int] = []
        seq_ids: list[int] = []
        flags: list[int] = []
        for seq_id, run, start in rows:
            for offset, token in enumerate(run):
                if len(tokens) == self.batch.capacity:
                    picks += self._decode(tokens, pos, seq_ids, flags)
                    tokens, pos, seq_ids, flags = [], [], [], []
                tokens.append(token)
                pos.append(start + offset)
                seq_ids.append(seq_id)
                flags.append(int(logits and offset == len(run) - 1))
        if tokens:
            picks += self._decode(tokens, pos, seq_ids, flags)
        return picks

    def _decode(self, tokens: list[int], pos: list[int], seq_ids: list[int], logits: list[int]) -> list[int]:
        self.batch.set(tokens, pos, seq_ids, logits)
        self.ctx.decode(self.batch)
        if not self.batch.n_outputs:
            return []
        rows = self.ctx.output_logits(self.batch.n_outputs, self.model.vocab.n_vocab)
        return [int(t) for t in rows[:, : self.n_vocab].argmax(axis=1)]

    def close(self) -> None:
        """Free the batch, the context, then the model (safe to call again)."""
        self.batch.close()
        self.ctx.close()
        self.model.close()


def check_same_vocabulary(target: Vocab, draft: Vocab, name: str) -> None:
    """Refuse a draft model whose token ids mean something else than the target's: its drafts
    would be other tokens. Compared as llama.cpp's speculative tools do: vocabulary type,
    BOS/EOS, sizes within VOCAB_SIZE_SLACK, and the text of every id both have."""
    problems = []
    kinds = llama_cpp.llama_vocab_type(target.handle), llama_cpp.llama_vocab_type(draft.handle)
    if kinds[0] != kinds[1]:
        problems.append(f"tokenizer type {kinds[1]} vs the target's {kinds[0]}")
    if (draft.bos, draft.eos) != (target.bos, target.eos):
        problems.append(f"BOS/EOS ids {draft.bos}/{draft.eos} vs the target's {target.bos}/{target.eos}")
    if abs(draft.n_vocab - target.n_vocab) > VOCAB_SIZE_SLACK:
        problems.append(f"{draft.n_vocab} tokens vs the target's {target.n_vocab}")
    if not problems:
        differ = next((t for t in range(min(draft.n_vocab, target.n_vocab)) if draft.text(t) != target.text(t)), None)
        if differ is not None:
            problems.append(f"token {differ} is {draft.text(differ)!r}, the target's is {target.text(differ)!r}")
    if problems:
        raise ModelError(f"draft model {name} does not share the target's vocabulary: {'; '.join(problems)}")
