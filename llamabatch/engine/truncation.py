"""What llama.cpp's truncation samplers (top-k, top-p, min-p) and temperature leave of a row of
logits, and a draw from it, found without sorting the vocabulary.

llama.cpp's chain copies the whole vocabulary into candidates, softmaxes it and, for a top-p
whose nucleus passes 256 tokens, sorts all of it: about 5 ms a row for Gemma's 262,144 tokens.
Here the candidates are looked for within a band below the best logit, widened until it holds
them, and only those are sorted; passes over the whole row are a handful of vector operations
into buffers reused from row to row (a fresh megabyte per row costs more in page faults than the
arithmetic).
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np


class Truncation(Protocol):
    """The sampling fields truncation reads (SamplingParams has them)."""

    top_k: int
    top_p: float
    min_p: float
    temperature: float

# Widening thresholds (nats below the best logit) within which a truncation looks for its tokens
# before looking at all of them: a comparison over the vocabulary is cheap, its sort is not.
_BANDS = (2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
# float32's exp underflows (to slow denormals, then 0) past -87: a token whose tempered logit is
# that far below the best one cannot be drawn (its weight would be under 1e-38 of the best's).
_EXP_RANGE = np.float32(87.0)
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
        return _pick(_weights(logits, params.temperature, out=scratch.values), u)
    return int(ids[_pick(_weights(logits[ids], params.temperature), u)])


def distribution(logits: np.ndarray, params: Truncation, scratch: Scratch) -> tuple[np.ndarray, np.ndarray]:
    """The candidates' token ids (most likely first where truncated, else every token that can be
    drawn) and their probabilities."""
    ids = candidates(logits, params, scratch)
    if ids is None:
        ids = np.flatnonzero(logits >= logits.max() - _EXP_RANGE * np.float32(params.temperature))
    weights = _weights(logits[ids], params.temperature).astype(np.float64)
    return ids, weights / weights.sum()


def candidates(logits: np.ndarray, params: Truncation, scratch: Scratch) -> np.ndarray | None:
    """The tokens llama.cpp's truncation keeps (top-k, then top-p over their softmax, then min-p),
    most likely first; None when it keeps every token. Sums are float64: llama.cpp's are float32
    (the softmax's in id order, the running one in rank order), which drift over thousands of small
    terms, so its nucleus may end a few tokens before this one, on the same ranking (measured on
    Gemma 3's own rows at top_p 0.95: in 58% of them, 1 to 21 tokens holding 0.03% of the
    probability in the median, 0.15% at most)."""
    best = logits.max()
    ids = None
    if 0 < params.top_k < len(logits):
        ids = _within_band(logits, best, lambda top: len(top) >= params.top_k, scratch)[: params.top_k]
    if params.top_p < 1:
        ids = _nucleus(logits, best, ids, params.top_p, scratch)
    if params.min_p > 0:  # p >= min_p * p_max over what is left, whose best is the row's best
        floor = best + np.log(np.float32(params.min_p))
        ids = _above(logits, floor, scratch) if ids is None else ids[logits[ids] >= floor]
    return ids


def _weights(logits: np.ndarray, temperature: float, out: np.ndarray | None = None) -> np.ndarray:
    """Unnormalised probabilities after temperature, float32 (the best token's is 1), in `out` if given."""
    weights = np.subtract(logits, logits.max(), out=out)
    np.divide(weights, np.float32(temperature), out=weights)
    return np.exp(np.maximum(weights, -_EXP_RANGE, out=weights), out=weights)


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


def _above(logits: np.ndarray, floor: float, scratch: Scratch) -> np.ndarray:
    """Ids of the tokens whose logit is >= floor, highest first (ties in id order)."""
    ids = np.flatnonzero(np.greater_equal(logits, floor, out=scratch.mask))
    return ids[np.argsort(-logits[ids], kind="stable")]


def _within_band(logits: np.ndarray, best: float, enough: Callable[[np.ndarray], bool], scratch: Scratch) -> np.ndarray:
    """The tokens of the narrowest band below `best` that is `enough`, highest first."""
    for band in _BANDS:
        top = _above(logits, best - band, scratch)
        if enough(top):
            return top
    return _above(logits, -np.inf, scratch)


def _nucleus(logits: np.ndarray, best: np.float32, ids: np.ndarray | None, top_p: float, scratch: Scratch) -> np.ndarray:
    """Top-p as llama.cpp defines it: the candidates' softmax (all tokens, or top-k's), then the
    most likely until their probabilities add up to top_p (at least one)."""
    if ids is not None:
        weights = np.exp(logits[ids] - best).astype(np.float64)
        running = np.cumsum(weights) / weights.sum()
        return ids[: min(int(np.searchsorted(running, top_p, side="left")), len(ids) - 1) + 1]
    weights = np.exp(np.subtract(logits, best, out=scratch.values), out=scratch.values)  # untempered: no underflow to fear
    total = weights.sum(dtype=np.float64)
    for band in (*_BANDS, np.inf):
        top = _above(logits, best - band, scratch)
        running = np.cumsum(weights[top], dtype=np.float64) / total
        at = int(np.searchsorted(running, top_p, side="left"))
        if at < len(top) or band == np.inf:
            return top[: min(at, len(top) - 1) + 1]
    raise AssertionError("unreachable: the last band holds every token")
