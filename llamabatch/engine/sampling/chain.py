"""Which sampler a row gets (build_sampler), and llama.cpp's own sampler chain for the rows that
ask for samplers the batched path does not implement: DRY, XTC, mirostat (v1, v2), typical-p, top-n-σ, dynamic temperature,
infill, or a chain in an order of their own (llama-server's `samplers`). Each such
sequence owns a native chain (freed by close()), built in llama-server's order; every other row
keeps the engine's own sampling, untouched by these.

The chain sees the row after the engine's own logit bias, penalties, min_tokens and bad words
(RowSampler.adjusted), then: DRY, top-n-σ, top-k, typical-p, top-p, min-p, XTC, temperature
(with its dynamic range) and the seeded draw; or, with mirostat, temperature and mirostat's draw
(common/sampling.cpp's two orders)."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from ..native.handles import Vocab
from .samplers import GreedySampler, RowSampler
from .params import SamplingParams
from .truncation import Scratch

DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp: a random seed
MIROSTAT_M = 100  # candidates mirostat v1 estimates s_hat from (llama.cpp's value)
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


def build_sampler(params: SamplingParams, n_ctx: int, vocab: Vocab | None = None, n_prompt: int = 0) -> GreedySampler | RowSampler:
    """Plain greedy gets the step's one argmax; llama.cpp's further samplers a native chain of
    their own (ChainSampler); anything else its own RowSampler."""
    if params.plain_greedy:
        return GreedySampler()
    if params.uses_chain:
        assert vocab is not None, "llama.cpp's chain samplers read the vocabulary"
        return ChainSampler(params, n_ctx, vocab, n_prompt)
    return RowSampler(params, n_ctx, vocab, n_prompt)


class ChainSampler(RowSampler):
    """A row drawn by a llama.cpp sampler chain of its own (after RowSampler's adjustments)."""

    def __init__(self, params: SamplingParams, n_ctx: int, vocab: Vocab, n_prompt: int) -> None:
        super().__init__(params, n_ctx, vocab, n_prompt)
        self.n_vocab = vocab.n_vocab
        self.chain = chain_for(params, vocab, n_ctx)
        self.n_accepted = 0  # tokens of the sequence the chain has seen (DRY, mirostat keep history)
        self._data = (llama_cpp.llama_token_data * self.n_vocab)()
        self._view = np.frombuffer(self._data, dtype=TOKEN_DATA)

    def sample(self, logits: np.ndarray, tokens: list[int], scratch: Scratch) -> int:
        for token in tokens[self.n_accepted:]:
            llama_cpp.llama_sampler_accept(self.chain, token)
        self.n_accepted = len(tokens) + 1  # the token drawn now is accepted by the chain itself
        row = self.adjusted(logits, tokens, scratch.row)
        self._view["id"] = np.arange(self.n_vocab, dtype=np.int32)
        self._view["logit"] = row
        self._view["p"] = 0.0
        candidates = llama_cpp.llama_token_data_array(self._data, self.n_vocab, -1, False)
        llama_cpp.llama_sampler_apply(self.chain, ctypes.byref(candidates))
        token = int(candidates.data[candidates.selected].id)
        llama_cpp.llama_sampler_accept(self.chain, token)
        return token

    def close(self) -> None:
        if self.chain is not None:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None


def chain_for(params: SamplingParams, vocab: Vocab, n_ctx: int):
    """A native chain for these parameters (the caller frees it); greedy (argmax) at the end when
    temperature is 0, else a draw seeded with params.seed."""
    p = params
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    seed = DEFAULT_SEED if p.seed is None else p.seed

    def add(sampler) -> None:
        llama_cpp.llama_sampler_chain_add(chain, sampler)

    if p.samplers is not None:
        for name in p.samplers:
            sampler = _named(name, p, vocab, n_ctx, seed)
            if sampler is not None:
                add(sampler)
        add(llama_cpp.llama_sampler_init_greedy() if p.temperature == 0 else llama_cpp.llama_sampler_init_dist(seed))
        return chain
    if p.dry_multiplier > 0:
        add(_dry(p, vocab, n_ctx))
    if p.temperature == 0:
        add(llama_cpp.llama_sampler_init_greedy())
    elif p.mirostat == 1:
        add(llama_cpp.llama_sampler_init_temp_ext(p.temperature, p.dynatemp_range, p.dynatemp_exponent))
        add(llama_cpp.llama_sampler_init_mirostat(vocab.n_vocab, seed, p.mirostat_tau, p.mirostat_eta, MIROSTAT_M))
    elif p.mirostat == 2:
        add(llama_cpp.llama_sampler_init_temp_ext(p.temperature, p.dynatemp_range, p.dynatemp_exponent))
        add(llama_cpp.llama_sampler_init_mirostat_v2(seed, p.mirostat_tau, p.mirostat_eta))
    else:
        if p.top_n_sigma > 0:
            add(llama_cpp.llama_sampler_init_top_n_sigma(p.top_n_sigma))
        if p.top_k > 0:
            add(llama_cpp.llama_sampler_init_top_k(p.top_k))
        if p.typical_p < 1:
            add(llama_cpp.llama_sampler_init_typical(p.typical_p, 1))
        if p.top_p < 1:
            add(llama_cpp.llama_sampler_init_top_p(p.top_p, 1))
        if p.min_p > 0:
            add(llama_cpp.llama_sampler_init_min_p(p.min_p, 1))
        if p.xtc_probability > 0:
            add(llama_cpp.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, 1, seed))
        add(llama_cpp.llama_sampler_init_temp_ext(p.temperature, p.dynatemp_range, p.dynatemp_exponent))
        add(llama_cpp.llama_sampler_init_dist(seed))
    return chain


def _dry(p: SamplingParams, vocab: Vocab, n_ctx: int):
    breakers = [b.encode() for b in p.dry_sequence_breakers]
    array = (ctypes.c_char_p * len(breakers))(*breakers)
    last_n = n_ctx if p.dry_penalty_last_n == -1 else p.dry_penalty_last_n
    return llama_cpp.llama_sampler_init_dry(vocab.handle, p.dry_multiplier, p.dry_base, p.dry_allowed_length, last_n, array, len(breakers))


def _named(name: str, p: SamplingParams, vocab: Vocab, n_ctx: int, seed: int):
    """The llama.cpp sampler llama-server's `samplers` names, with the request's values (None:
    nothing to add; penalties came first, in RowSampler.adjusted)."""
    if name == "dry":
        return _dry(p, vocab, n_ctx) if p.dry_multiplier > 0 else None
    if name == "top_n_sigma":
        return llama_cpp.llama_sampler_init_top_n_sigma(p.top_n_sigma)
    if name == "top_k":
        return llama_cpp.llama_sampler_init_top_k(p.top_k)
    if name in ("typ_p", "typical_p"):
        return llama_cpp.llama_sampler_init_typical(p.typical_p, 1)
    if name == "top_p":
        return llama_cpp.llama_sampler_init_top_p(p.top_p, 1)
    if name == "min_p":
        return llama_cpp.llama_sampler_init_min_p(p.min_p, 1)
    if name == "xtc":
        return llama_cpp.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, 1, seed)
    if name == "temperature":
        return llama_cpp.llama_sampler_init_temp_ext(p.temperature, p.dynatemp_range, p.dynatemp_exponent) if p.temperature else None
    if name == "infill":  # merges candidates that begin alike, and ends the middle where the end is likely
        return llama_cpp.llama_sampler_init_infill(vocab.handle)
    return None  # penalties
