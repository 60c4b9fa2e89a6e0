"""llama.cpp's further samplers, per request: DRY, XTC, mirostat v1/v2, typical-p, top-n-σ and
dynamic temperature (a llama.cpp chain of the row's own), min_tokens and bad words (the engine's
row adjustments). Each is checked against a llama.cpp chain built here, directly."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import httpx
import llama_cpp
import numpy as np
import pytest

from llamabatch.engine import SamplingParams
from llamabatch.engine.sampling.chain import ChainSampler, build_sampler
from llamabatch.engine.native.handles import Model
from llamabatch.engine.native.backend import init_backend
from llamabatch.engine.sampling.samplers import GreedySampler, RowSampler
from llamabatch.engine.sampling.truncation import Scratch

SEED = 7
# Each sampler strong enough to change what is drawn, with the rest at SamplingParams' defaults
# (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8).
CASES = {
    "dry": dict(dry_multiplier=3.0, dry_base=1.75, dry_allowed_length=2, dry_penalty_last_n=-1),
    "xtc": dict(xtc_probability=1.0, xtc_threshold=0.05),
    "mirostat": dict(mirostat=1, mirostat_tau=3.0, mirostat_eta=0.2),
    "mirostat_v2": dict(mirostat=2, mirostat_tau=3.0, mirostat_eta=0.2),
    "typical": dict(typical_p=0.3),
    "top_n_sigma": dict(top_n_sigma=0.5),
    "dynatemp": dict(dynatemp_range=0.7, dynatemp_exponent=2.0),
}


@pytest.fixture(scope="module")
def vocab(tiny_model):
    init_backend(False)
    model = Model(tiny_model, 0)
    yield model.vocab
    model.close()


def reference_chain(params: SamplingParams, vocab, n_ctx: int, with_sampler: bool = True):
    """llama-server's chain (common/sampling.cpp's order) for these parameters, built here from
    llama.cpp's own samplers; without the case's sampler when with_sampler is False."""
    p = params
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = lambda s: llama_cpp.llama_sampler_chain_add(chain, s)  # noqa: E731
    if with_sampler and p.dry_multiplier > 0:
        breakers = (ctypes.c_char_p * 4)(b"\n", b":", b'"', b"*")
        add(llama_cpp.llama_sampler_init_dry(vocab.handle, p.dry_multiplier, p.dry_base, p.dry_allowed_length, n_ctx, breakers, 4))
    temp = (p.temperature, p.dynatemp_range if with_sampler else 0.0, p.dynatemp_exponent)
    if with_sampler and p.mirostat:
        add(llama_cpp.llama_sampler_init_temp_ext(*temp))
        add(llama_cpp.llama_sampler_init_mirostat(vocab.n_vocab, SEED, p.mirostat_tau, p.mirostat_eta, 100) if p.mirostat == 1
            else llama_cpp.llama_sampler_init_mirostat_v2(SEED, p.mirostat_tau, p.mirostat_eta))
        return chain
    if with_sampler and p.top_n_sigma > 0:
        add(llama_cpp.llama_sampler_init_top_n_sigma(p.top_n_sigma))
    add(llama_cpp.llama_sampler_init_top_k(p.top_k))
    if with_sampler and p.typical_p < 1:
        add(llama_cpp.llama_sampler_init_typical(p.typical_p, 1))
    add(llama_cpp.llama_sampler_init_top_p(p.top_p, 1))
    add(llama_cpp.llama_sampler_init_min_p(p.min_p, 1))
    if with_sampler and p.xtc_probability > 0:
        add(llama_cpp.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, 1, SEED))
    add(llama_cpp.llama_sampler_init_temp_ext(*temp))
    add(llama_cpp.llama_sampler_init_dist(SEED))
    return chain


def reference_draw(chain, row: np.ndarray) -> int:
    data = (llama_cpp.llama_token_data * len(row))(*(llama_cpp.llama_token_data(i, float(v), 0.0) for i, v in enumerate(row)))
    candidates = llama_cpp.llama_token_data_array(data, len(row), -1, False)
    llama_cpp.llama_sampler_apply(chain, ctypes.byref(candidates))
    token = candidates.data[candidates.selected].id
    llama_cpp.llama_sampler_accept(chain, token)
    return token


def rows_for(case: str, n_vocab: int, history: list[int], steps: int) -> list[np.ndarray]:
    """Rows of logits, fairly flat; for DRY, each favouring the token that would go on repeating
    the history (which DRY is there to penalise)."""
    rng = np.random.default_rng(3)
    rows = [(rng.standard_normal(n_vocab) * 1.5).astype(np.float32) for _ in range(steps)]
    if case == "dry":
        for row in rows:
            row[history[-4]] += 4.0
    return rows


@pytest.mark.parametrize("case", CASES)
def test_each_sampler_draws_as_a_llama_cpp_chain_built_directly(vocab, case):
    params = SamplingParams(seed=SEED, **CASES[case])
    history = [40, 41, 42, 43] * 6  # a prompt that repeats itself
    rows = rows_for(case, vocab.n_vocab, history, 60)
    ours = ChainSampler(params, 256, vocab, len(history))
    assert isinstance(build_sampler(params, 256, vocab, len(history)), ChainSampler)
    tokens, scratch = list(history), Scratch(vocab.n_vocab)
    drawn = []
    for row in rows:
        drawn.append(ours.sample(row, tokens, scratch))
        tokens.append(drawn[-1])
    ours.close()
    reference, plain = (reference_chain(params, vocab, 256, kept) for kept in (True, False))
    for chain in (reference, plain):
        for token in history:
            llama_cpp.llama_sampler_accept(chain, token)
    expected = [reference_draw(reference, row) for row in rows]
    without = [reference_draw(plain, row) for row in rows]
    for chain in (reference, plain):
        llama_cpp.llama_sampler_free(chain)
    assert drawn == expected
    assert drawn != without  # the sampler did change what was drawn


def test_the_common_path_keeps_its_own_samplers(vocab):
    assert isinstance(build_sampler(SamplingParams(temperature=0), 256, vocab), GreedySampler)
    for params in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, top_k=0, min_p=0)):
        sampler = build_sampler(params, 256, vocab)
        assert type(sampler) is RowSampler
    assert not SamplingParams(dry_multiplier=0.5).verifiable  # drafts are not verified against a chain's draw


def test_min_tokens_holds_off_the_end(make_engine, tiny_eos_model):
    """A model whose every greedy choice is EOS: min_tokens 5 makes it write 5 tokens first."""
    engine = make_engine(tiny_eos_model)
    plain, held = engine.submit(["hello", "hello"], [SamplingParams(temperature=0, max_tokens=20),
                                                     SamplingParams(temperature=0, max_tokens=20, min_tokens=5)])
    while engine.has_work:
        engine.step()
    assert (plain.n_generated, plain.finish_reason) == (1, "stop")
    assert (held.n_generated, held.finish_reason) == (6, "stop")
    assert not any(engine.vocab.is_eog(t) for t in held.tokens[held.n_prompt:-1])


def test_bad_words_are_never_completed(vocab):
    """A bad word's last token is banned right after the rest of it, and nowhere else (in both
    of its spellings: with and without a space before)."""
    for spelling in ("capital", " capital"):
        word = vocab.tokenize(spelling, add_special=False)
        assert len(word) > 1
        sampler = RowSampler(SamplingParams(temperature=0, bad_words=("capital",)), 256, vocab)
        row = np.zeros(vocab.n_vocab, dtype=np.float32)
        row[word[-1]] = 5.0
        assert sampler.sample(row, [1, *word[:-1]], Scratch(vocab.n_vocab)) != word[-1]
        assert sampler.sample(row, [1, *word[:-2]], Scratch(vocab.n_vocab)) == word[-1]


def test_the_samplers_are_request_fields_with_400s_for_bad_values(base):
    fields = {"dry_multiplier": 0.8, "dry_sequence_breakers": ["\n"], "xtc_probability": 0.5, "typical_p": 0.9, "top_n_sigma": 1.5,
              "dynatemp_range": 0.3, "min_tokens": 2, "bad_words": ["the"]}
    answer = httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 6, "seed": 1, **fields})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 2
    for mirostat in (1, 2):
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 4, "mirostat": mirostat}).status_code == 200
    for bad, named in (({"dry_base": 0.5}, "dry_base"), ({"mirostat": 3}, "mirostat"), ({"typical_p": 0}, "typical_p"),
                       ({"xtc_probability": 2}, "xtc_probability"), ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
                       ({"dry_allowed_length": 0}, "dry_allowed_length"), ({"bad_words": [""]}, "bad_words")):
        answer = httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 4, **bad})
        assert answer.status_code == 400 and named in answer.json()["error"]["message"], answer.text


def test_the_samplers_are_options_of_run(tiny_model):
    command = [sys.executable, "-m", "llamabatch.cli", "run", "-m", str(tiny_model), "-p", "hello", "--max-tokens", "6", "--ctx", "512",
               "--dry-multiplier", "0.8", "--dry-sequence-breaker", "\n", "--mirostat", "2", "--min-tokens", "3", "--bad-word", "the"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    refused = subprocess.run([*command[:10], "--mirostat", "3"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "mirostat must be 0 (off), 1 or 2, got 3" in refused.stderr + refused.stdout
