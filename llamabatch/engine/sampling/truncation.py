"""What llama.cpp's truncation samplers (top-k, top-p, min-p) and temperature leave of a row of
logits, and a draw from it, found without sorting the vocabulary.

llama.cpp's chain copies the whole vocabulary into candidates, softmaxes it and, for a top-p
whose nucleus passes 256 tokens, sorts all of it: about 5 ms a row for Gemma's 262,144 tokens.
Here the candidates are looked for within a band below the best logit, widened until it holds
them, and only those are ranked. A band is searched for only in the blocks of the row whose best
logit reaches it (one pass finds every block's best), so a top-k reads the whole row about once;
a top-p a few times more, as its total needs every token's weight. Whole-row passes write into
buffers reused from row to row (a fresh megabyte per row costs more in page faults than the
arithmetic). On 256 of Gemma 3's own rows (AMD EPYC) the blocks and the ranking took a row at
top-p 0.95 without top-k from 465 to 374 us, at top-k 40 from 181 to 158 us; the first pass over
a row the decode just wrote, from memory, is about half of the latter.

No band ever holds more than the tokens that can be drawn: a row a constraint has masked down to
three tokens, or a bias pushed far below the rest, ranks those few (a top-k of 40 asks for more
than exist; the widest band then stops at the drawable floor instead of ranking 262,144 ids).
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np


class Truncation(Protocol):
    """The sampling fields truncation reads (SamplingParams has them, frozen)."""

    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def temperature(self) -> float: ...

# Widening thresholds (nats below the best logit) within which a truncation looks for its tokens
# before looking at all of them: a comparison over the vocabulary is cheap, its sort is not.
_BANDS = (2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
# float32's exp underflows (to slow denormals, then 0) past -87: a token whose tempered logit is
# that far below the best one cannot be drawn (its weight would be under 1e-38 of the best's).
_EXP_RANGE = np.float32(87.0)
_F32_MAX = float(np.finfo(np.float32).max)
# Tokens a block: a band's tokens are looked for in the blocks whose best logit is within it.
_BLOCK = 1024
# Up to this many ids are ranked by a stable argsort, more by a sort of 64-bit keys (_ranked).
_SMALL_SORT = 512
# A draw from many weights goes by blocks: the block holding the draw from the blocks' sums, then
# the token within it, instead of a running sum over the whole vocabulary.
_DRAW_BLOCK = 1024


class Scratch:
    """Row-sized buffers a step's sampling reuses from row to row."""

    def __init__(self, n_vocab: int) -> None:
        self.values = np.empty(n_vocab, dtype=np.float32)
        self.mask = np.empty(n_vocab, dtype=np.bool_)
        self.row = np.empty(n_vocab, dtype=np.float32)  # a row with logit bias and penalties


def draw(logits: np.ndarray, params: Truncation, u: float, scratch: Scratch) -> int:
    """The token a uniform draw u (in [0, 1)) picks from what the truncation and temperature leave."""
    ids = candidates(logits, params, scratch)
    if ids is None:  # nothing truncated: the whole row's weights, in place
        best = logits.max()
        if best == -np.inf:
            return 0  # every token banned: as below
        return _pick(_weights(logits, params.temperature, out=scratch.values, best=best), u)
    if not len(ids):  # every token banned: token 0 stands in, and the constraint that banned them all refuses it
        return 0
    return int(ids[_pick(_weights(logits[ids], params.temperature), u)])


def distribution(logits: np.ndarray, params: Truncation, scratch: Scratch) -> tuple[np.ndarray, np.ndarray]:
    """The candidates' token ids (most likely first where truncated, else every token that can be
    drawn) and their probabilities."""
    ids = candidates(logits, params, scratch)
    if ids is None:
        best = logits.max()
        ids = np.flatnonzero(logits >= best - _EXP_RANGE * _f32(params.temperature)) if best > -np.inf else np.zeros(0, np.int64)
    if not len(ids):  # every token banned
        return ids, np.zeros(0)
    weights = _weights(logits[ids], params.temperature).astype(np.float64)
    return ids, weights / weights.sum()


def candidates(logits: np.ndarray, params: Truncation, scratch: Scratch) -> np.ndarray | None:
    """The tokens llama.cpp's truncation keeps (top-k, then top-p over their softmax, then min-p),
    most likely first; None when it keeps every token. Sums are float64: llama.cpp's are float32
    (the softmax's in id order, the running one in rank order), which drift over thousands of small
    terms, so its nucleus may end a few tokens before this one, on the same ranking (measured on
    Gemma 3's own rows at top_p 0.95: in 58% of them, 1 to 21 tokens holding 0.03% of the
    probability in the median, 0.15% at most)."""
    if not (0 < params.top_k < len(logits) or params.top_p < 1 or params.min_p > 0):
        return None  # before any pass over the row: the caller's weights find its best
    row = _Row(logits)
    if row.best == -np.inf:  # every token banned (a constraint that allows none): nothing to draw from
        return np.zeros(0, dtype=np.int64)
    ids = None
    floor = _drawable_floor(row.best, params.temperature)
    if 0 < params.top_k < len(logits):
        ids = _within_band(row, lambda top: len(top) >= params.top_k, floor, scratch)[: params.top_k]
    if params.top_p < 1:
        ids = _nucleus(row, ids, params.top_p, floor, scratch)
    if params.min_p > 0:  # p >= min_p * p_max over what is left, whose best is the row's best
        floor = row.best + np.log(np.float32(params.min_p))
        ids = row.above(floor, scratch) if ids is None else ids[logits[ids] >= floor]
    return ids


class _Row:
    """A row of logits with the best logit of each of its blocks (the last may be shorter)."""

    def __init__(self, logits: np.ndarray) -> None:
        self.logits = logits
        self.n_whole = len(logits) // _BLOCK
        self.blocks = logits[: self.n_whole * _BLOCK].reshape(self.n_whole, _BLOCK)
        self.maxima = self.blocks.max(axis=1) if self.n_whole else np.empty(0, np.float32)
        if len(logits) > self.n_whole * _BLOCK:
            self.maxima = np.append(self.maxima, logits[self.n_whole * _BLOCK :].max())
        self.best = self.maxima.max()

    def above(self, floor: float, scratch: Scratch, ranked: bool = True) -> np.ndarray:
        """Ids of the tokens whose logit is >= floor, highest first (ties in id order) when
        `ranked`, else in id order."""
        logits = self.logits
        reaching = np.flatnonzero(self.maxima >= floor)
        if len(reaching) * 4 > len(self.maxima):  # most blocks: one pass over the row
            ids = np.flatnonzero(np.greater_equal(logits, floor, out=scratch.mask))
        else:
            whole = reaching[reaching < self.n_whole]
            at = np.flatnonzero(self.blocks[whole] >= floor)
            ids = whole[at // _BLOCK] * _BLOCK + at % _BLOCK
            if len(whole) < len(reaching):  # the shorter last block
                start = self.n_whole * _BLOCK
                ids = np.concatenate([ids, start + np.flatnonzero(logits[start:] >= floor)])
        return _ranked(ids, logits[ids]) if ranked else ids


def _ranked(ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Ids (ascending) by their values, highest first, ties in id order. Past a few hundred, one
    sort of 64-bit keys (the value's order in the high half, the id in the low half) beats a
    stable argsort of the values by up to 12x (5,000 ids: 22 against 165 us)."""
    if len(ids) <= _SMALL_SORT:
        return ids[np.argsort(-values, kind="stable")]
    bits = (np.float32(0) - values).view(np.int32)  # 0 - v: no -0.0, which would not tie with 0.0
    order = np.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits).astype(np.int64)  # as the floats order
    return np.sort((order << 32) | ids) & 0xFFFFFFFF


def _weights(logits: np.ndarray, temperature: float, out: np.ndarray | None = None, best: float | None = None) -> np.ndarray:
    """Unnormalised probabilities after temperature, float32 (the best token's is 1), in `out` if
    given; `best`: the logits' maximum, when the caller has it."""
    weights = np.subtract(logits, logits.max() if best is None else best, out=out)
    np.divide(weights, _f32(temperature), out=weights)
    return np.exp(np.maximum(weights, -_EXP_RANGE, out=weights), out=weights)


def _f32(x: float) -> np.float32:
    """A float32, the largest finite one for anything larger (a temperature of 1e60 flattens the
    row as infinity would, without numpy's overflow warning)."""
    return np.float32(min(x, _F32_MAX))


def _pick(weights: np.ndarray, u: float) -> int:
    """The index at which u of the weights' running total is reached."""
    n = len(weights)
    if n <= _DRAW_BLOCK:
        running = np.cumsum(weights, dtype=np.float64)
        return min(int(np.searchsorted(running, u * running[-1], side="right")), n - 1)
    blocks = np.add.reduceat(weights, np.arange(0, n, _DRAW_BLOCK), dtype=np.float64)
    running = np.cumsum(blocks)
    block = min(int(np.searchsorted(running, u * running[-1], side="right")), len(blocks) - 1)
    start = block * _DRAW_BLOCK
    inside = np.cumsum(weights[start : start + _DRAW_BLOCK], dtype=np.float64)
    target = u * running[-1] - (running[block - 1] if block else 0.0)
    return start + min(int(np.searchsorted(inside, target, side="right")), len(inside) - 1)


def _drawable_floor(best: float, temperature: float) -> float:
    """The lowest logit a draw can still pick: below it a token's weight underflows float32 at
    this temperature (or, below 1, at the untempered softmax top-p sums). Tokens under it (-inf
    from a mask, a bias of -100) take no part in any ranking: they would rank last, weightless,
    and the same u draws the same token without them."""
    return max(float(best) - float(_EXP_RANGE) * max(temperature, 1.0), -_F32_MAX)


def _within_band(row: _Row, enough: Callable[[np.ndarray], bool], floor: float, scratch: Scratch,
                 ranked: bool = True) -> np.ndarray:
    """The tokens of the narrowest band below the best logit that is `enough` (highest first when
    `ranked`); at widest, every token above the drawable floor."""
    for band in _BANDS:
        if row.best - band <= floor:
            break
        top = row.above(row.best - band, scratch, ranked)
        if enough(top):
            return top
    return row.above(floor, scratch, ranked)


def _nucleus(row: _Row, ids: np.ndarray | None, top_p: float, floor: float, scratch: Scratch) -> np.ndarray:
    """Top-p as llama.cpp defines it: the candidates' softmax (all tokens, or top-k's), then the
    most likely until their probabilities add up to top_p (at least one)."""
    logits, best = row.logits, row.best
    if ids is not None:
        weights = np.exp(logits[ids] - best).astype(np.float64)
        running = np.cumsum(weights) / weights.sum()
        return ids[: min(int(np.searchsorted(running, top_p, side="left")), len(ids) - 1) + 1]
    weights = np.exp(np.subtract(logits, best, out=scratch.values), out=scratch.values)  # untempered: no underflow to fear
    total = weights.sum(dtype=np.float64)
    # The narrowest band holding top_p of the mass, summed before it is ranked.
    top = _within_band(row, lambda band: weights[band].sum(dtype=np.float64) >= top_p * total, floor, scratch, ranked=False)
    top = _ranked(top, logits[top])
    running = np.cumsum(weights[top], dtype=np.float64) / total
    return top[: min(int(np.searchsorted(running, top_p, side="left")), len(top) - 1) + 1]
