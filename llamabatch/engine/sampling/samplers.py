"""The samplers each sequence draws with: the step's argmax for plain greedy rows, a RowSampler
for the rest; and log-probabilities of tokens under a row of logits."""

from __future__ import annotations

import numpy as np

from ..native.handles import Vocab
from ..results import PromptScore, TokenLogprob
from .params import SamplingParams
from .truncation import Scratch, draw


class GreedySampler:
    """Greedy sampling without penalties, done by the engine: one argmax over every such row of
    a step's logits. Same choice as llama.cpp's greedy sampler (the first highest logit)."""

    greedy = True

    def close(self) -> None:
        pass  # owns nothing native


class RowSampler:
    """Every other sequence's draw, from its row of a step's logits: llama.cpp's sampler chain in
    llama.cpp's order (logit bias, penalties over the last penalty_last_n tokens, prompt included,
    then top-k, top-p, min-p, temperature and a seeded draw), with the truncation found without a
    sort of the vocabulary (truncation.py). Its own generator draws, so a seed reproduces the same
    tokens whatever else is in the batch; they are not the tokens llama.cpp's generator draws."""

    greedy = False

    def __init__(self, params: SamplingParams, n_ctx: int, vocab: Vocab | None = None, n_prompt: int = 0) -> None:
        """`vocab` (for min_tokens and bad words) and `n_prompt` (where min_tokens counts from)."""
        self.params = params
        self.rng = np.random.default_rng(params.seed)  # None: fresh entropy
        bias = params.logit_bias or ()
        self.bias_ids = np.array([t for t, _ in bias], dtype=np.int64)
        self.bias_values = np.array([b for _, b in bias], dtype=np.float32)
        self.last_n = n_ctx if params.penalty_last_n == -1 else params.penalty_last_n
        self.penalised = params.uses_penalties and self.last_n > 0
        # min_tokens: the end-of-generation tokens are banned until the sequence has that many
        self.eog_ids = np.array(vocab.eog_ids if params.min_tokens else [], dtype=np.int64)
        self.until = n_prompt + params.min_tokens
        # bad words, as token sequences, with and without a space before (vLLM's bad_words)
        self.bad = sorted({tuple(vocab.tokenize(w, add_special=False)) for word in params.bad_words for w in (word, " " + word)} - {()})
        self.adjusts = bool(len(self.bias_ids) or self.penalised or self.bad or len(self.eog_ids))

    def sample(self, logits: np.ndarray, tokens: list[int], scratch: Scratch) -> int:
        """The next token after `tokens` (the prompt and what was generated) from this row."""
        if self.adjusts:
            logits = self.adjusted(logits, tokens, scratch.row)
        if self.params.temperature == 0:  # greedy after the bias and penalties
            return int(logits.argmax())
        return draw(logits, self.params, self.rng.random(), scratch)

    def adjusted(self, logits: np.ndarray, tokens: list[int], out: np.ndarray) -> np.ndarray:
        """The row with the bias, penalties, min_tokens and bad words, in `out` (the row itself
        when none applies): the step's row stays as it was (log-probabilities are reported from
        it, and followers may sample from it too)."""
        if not (len(self.bias_ids) or self.penalised or self.bad or (len(self.eog_ids) and len(tokens) < self.until)):
            return logits
        np.copyto(out, logits)
        out[self.bias_ids] += self.bias_values  # the ids are distinct (params keep one bias a token)
        if self.penalised:
            seen, counts = np.unique(np.asarray(tokens[-self.last_n :], dtype=np.int64), return_counts=True)
            p = self.params
            values = out[seen]
            values = np.where(values <= 0, values * p.repeat_penalty, values / p.repeat_penalty)
            out[seen] = values - (counts * p.frequency_penalty + p.presence_penalty).astype(np.float32)
        if len(self.eog_ids) and len(tokens) < self.until:
            out[self.eog_ids] = -np.inf
        for word in self.bad:  # its last token, where the text so far ends with the rest of it
            if len(word) == 1 or tuple(tokens[len(tokens) - len(word) + 1:]) == word[:-1]:
                out[word[-1]] = -np.inf
        return out

    def close(self) -> None:
        pass  # owns nothing native


def token_logprob(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """The token's log-probability under softmax(logits), and the k most likely tokens'."""
    peak = float(logits.max())
    log_total = peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))
    top = np.argpartition(-logits, k)[:k] if k else np.empty(0, dtype=np.int64)
    top = top[np.argsort(-logits[top])]
    rank = 1 + int((logits > logits[token]).sum())
    return TokenLogprob(token, float(logits[token]) - log_total, tuple((int(t), float(logits[t]) - log_total) for t in top), rank)


# Scored rows are worked through this many bytes of logits at a time: float64 temporaries of a
# 262k-token vocabulary would otherwise take gigabytes for a long chunk.
SCORE_PASS_BYTES = 16 << 20


def score_rows(score: PromptScore, logits: np.ndarray, targets: list[int], k: int | None) -> None:
    """Add to `score` the log-probability of each target token under its row of logits (row i
    predicts targets[i]), computed as token_logprob does; with k, keep each token and its k
    most likely alternatives too."""
    n_rows, n_vocab = logits.shape
    per_pass = max(1, SCORE_PASS_BYTES // (4 * n_vocab))
    wanted = np.asarray(targets)
    for a in range(0, n_rows, per_pass):
        rows, want = logits[a : a + per_pass], wanted[a : a + per_pass]
        peak = rows.max(axis=1)
        log_total = peak + np.log(np.exp(rows - peak[:, None], dtype=np.float64).sum(axis=1))
        chosen = rows[np.arange(len(want)), want]
        score.logprob += float((chosen - log_total).sum())
        score.n_tokens += len(want)
        score.greedy = score.greedy and bool((chosen >= peak).all())  # a tie counts as greedy
        if k is not None:
            score.tokens += [token_logprob(row, int(t), k) for row, t in zip(rows, want)]
