import warnings
from collections import Counter

import numpy as np
import pytest
import scipy.stats

from llamabatch import SamplingError, SamplingParams
from llamabatch.engine.sampling.chain import build_sampler
from llamabatch.engine.sampling.samplers import GreedySampler, RowSampler
from llamabatch.engine.sampling.truncation import Scratch, distribution

from reference import reference_distribution, reference_penalties


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", -1, "max_tokens must be >= 0"),
        ("prompt_logprobs", 21, "prompt_logprobs must be in [0, 20]"),
        ("temperature", -0.1, "temperature must be >= 0"),
        ("top_k", -1, "top_k must be >= 0"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("top_p", 1.5, "top_p must be in (0, 1]"),
        ("min_p", 2.0, "min_p must be in [0, 1]"),
        ("repeat_penalty", 0.0, "repeat_penalty must be >= 0.01"),
        ("repeat_penalty", 1e-50, "repeat_penalty must be >= 0.01"),
        ("presence_penalty", 3.0, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", -2.5, "frequency_penalty must be in [-2, 2]"),
        ("penalty_last_n", -2, "penalty_last_n must be >= -1"),
        ("seed", -1, "seed must be in"),
        ("stop", ("",), "stop strings must not be empty"),
    ],
)
def test_out_of_range_values_are_rejected_with_their_name(field, value, message):
    with pytest.raises(SamplingError, match=message.replace("(", r"\(").replace("[", r"\[")) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ValueError)


def test_stop_list_becomes_a_tuple():
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_plain_greedy_is_the_steps_argmax_and_the_rest_draw_on_their_own():
    assert isinstance(build_sampler(SamplingParams(temperature=0), n_ctx=256), GreedySampler)
    for params in (SamplingParams(temperature=0, repeat_penalty=1.1), SamplingParams(), SamplingParams(top_k=0, top_p=1, min_p=0)):
        assert isinstance(build_sampler(params, n_ctx=256), RowSampler)


# Rows of logits as models give them: peaked (a small model sure of its next token), flat (a
# random-weight model: thousands of tokens in the nucleus), and Gemma-sized (262,144 tokens).
ROWS = {
    "peaked": lambda rng: (rng.standard_normal(32_000) * 4).astype(np.float32),
    "flat": lambda rng: (rng.standard_normal(32_000) * 0.5).astype(np.float32),
    "gemma-sized": lambda rng: (rng.standard_normal(262_144) * 3).astype(np.float32),
}
TRUNCATIONS = [  # (top_k, top_p, min_p, temperature)
    (0, 0.95, 0.0, 0.8),  # what an OpenAI client sends
    (40, 0.95, 0.05, 0.8),  # llamabatch's defaults
    (0, 1.0, 0.0, 1.0),  # the whole vocabulary
    (0, 0.5, 0.1, 1.3), (100, 1.0, 0.0, 0.7), (0, 0.999, 0.0, 1.0), (5, 0.1, 0.0, 0.5),
]


def exact_candidates(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> list[int]:
    """The truncation's definition computed plainly: the vocabulary sorted, float64 sums."""
    order = [int(t) for t in np.argsort(-logits.astype(np.float64), kind="stable")]
    if 0 < top_k < len(order):
        order = order[:top_k]
    if top_p < 1:
        weights = np.exp(logits[order].astype(np.float64) - logits[order[0]])
        running = np.cumsum(weights / weights.sum())
        order = order[: int(np.searchsorted(running, top_p, side="left")) + 1]
    if min_p > 0:
        order = [t for t in order if logits[t] >= logits[order[0]] + np.log(np.float32(min_p))]
    return order


@pytest.mark.parametrize("shape", list(ROWS))
@pytest.mark.parametrize("top_k, top_p, min_p, temperature", TRUNCATIONS)
def test_the_distribution_is_the_truncations_and_llama_cpps(shape, top_k, top_p, min_p, temperature):
    """The tokens kept are the truncation's own (the vocabulary sorted, sums in float64), with the
    probabilities llama.cpp's samplers give them. llama.cpp keeps the same ranking but may end a
    nucleus a few tokens apart: its sums are float32, which drift over many small terms (on Gemma
    3's own rows at top_p 0.95: 1 to 21 edge tokens in 58% of them, 0.03% of the probability in
    the median; here, on a flat row of 262,144 tokens at top_p 0.999, thousands of 1e-6 each)."""
    rng = np.random.default_rng(hash((shape, top_k, top_p)) % 2**32)
    for _ in range(3):
        logits = ROWS[shape](rng)
        params = SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
        ids, probs = distribution(logits, params, Scratch(len(logits)))
        exact = exact_candidates(logits, top_k, top_p, min_p)
        if len(exact) < len(logits):  # truncated: the truncation's own tokens, most likely first
            n = min(len(ids), len(exact))
            assert ids[:n].tolist() == exact[:n]
            assert abs(len(ids) - len(exact)) <= 1  # float32 exp's last bit
        else:
            assert len(ids) >= 0.999 * len(logits)  # all but those a float32 exp cannot weigh
        theirs = reference_distribution(logits, top_k, top_p, min_p, temperature)
        ours = dict(zip(ids.tolist(), probs.tolist()))
        common = [t for t in ids.tolist() if t in theirs]
        rank = np.empty(len(logits), dtype=np.int64)
        rank[np.argsort(-logits.astype(np.float64), kind="stable")] = np.arange(len(logits))
        assert all(rank[t] >= len(common) for t in set(theirs) - set(common))  # they part only at the edge
        assert len(common) >= 0.95 * len(theirs)
        mine, llamas = np.array([ours[t] for t in common]), np.array([theirs[t] for t in common])
        assert np.allclose(mine / mine.sum(), llamas / llamas.sum(), rtol=1e-3, atol=1e-9)


@pytest.mark.parametrize("top_k, top_p, min_p, temperature", TRUNCATIONS)
def test_tied_logits_rank_by_token_id(top_k, top_p, min_p, temperature):
    """Logits rounded to tenths: thousands of ties (and -0.0 beside 0.0) in candidate sets both
    small and past the size ranked by 64-bit keys. Tied tokens rank in id order, as a stable sort
    of the vocabulary puts them (llama.cpp's own sorts leave ties in no set order)."""
    rng = np.random.default_rng(17)
    for _ in range(3):
        logits = np.round(rng.standard_normal(50_000) * 2, 1).astype(np.float32)
        ids, _ = distribution(logits, SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature),
                              Scratch(len(logits)))
        exact = exact_candidates(logits, top_k, top_p, min_p)
        if len(exact) < len(logits):
            n = min(len(ids), len(exact))
            assert ids[:n].tolist() == exact[:n]
            assert abs(len(ids) - len(exact)) <= 1


@pytest.mark.parametrize("top_k, top_p, min_p, temperature", [*TRUNCATIONS, (0, 1.0, 0.0, 1e60)])
def test_a_row_with_every_token_banned_draws_token_0_quietly(top_k, top_p, min_p, temperature):
    """A constraint that allows nothing leaves a row of -inf: there is nothing to draw, token 0
    stands in (the constraint then refuses it, and the sequence fails with its reason), and numpy
    warns of nothing. A temperature past float32's range flattens a row quietly too."""
    params = SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature, seed=3)
    banned = np.full(5_000, -np.inf, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert RowSampler(params, n_ctx=256).sample(banned, [], Scratch(len(banned))) == 0
        ids, probs = distribution(banned, params, Scratch(len(banned)))
        assert len(ids) == len(probs) == 0
        row = np.random.default_rng(4).standard_normal(5_000).astype(np.float32)
        assert 0 <= RowSampler(params, n_ctx=256).sample(row, [], Scratch(len(row))) < len(row)


@pytest.mark.parametrize("removed", [-np.inf, "bias"])
def test_a_row_masked_to_three_tokens_ranks_those_three(removed, monkeypatch):
    """A constraint that leaves 3 of Gemma's 262,144 tokens (or a bias of -100 on all the others),
    sampled at top-k 40 and top-p 0.95: the draw is among the three with their probabilities, and
    no pass sorts or partitions more than those three (top-k asks for more tokens than a mask
    leaves; the widest band used to rank the whole vocabulary then, 11 ms a row)."""
    rng = np.random.default_rng(23)
    logits = (rng.standard_normal(262_144) * 3).astype(np.float32)
    allowed = np.array([7, 131_000, 262_000])
    row = np.full_like(logits, -np.inf) if removed == -np.inf else logits - np.float32(100.0)
    row[allowed] = [2.0, 1.5, 0.3]
    sorted_sizes = []

    def watched(sort):
        def counted(a, *args, **kwargs):
            sorted_sizes.append(np.size(a))
            return sort(a, *args, **kwargs)
        return counted

    for name in ("sort", "argsort", "partition", "argpartition"):
        monkeypatch.setattr(np, name, watched(getattr(np, name)))
    params = SamplingParams(top_k=40, top_p=0.95, min_p=0.0, temperature=0.7, seed=5)
    scratch = Scratch(len(row))
    ids, probs = distribution(row, params, scratch)
    sampler = RowSampler(params, n_ctx=256)
    draws = [sampler.sample(row, [], scratch) for _ in range(50)]
    assert max(sorted_sizes) <= len(allowed)
    assert ids.tolist() == allowed.tolist()  # most likely first, all three inside the nucleus
    tempered = np.exp(np.array([2.0, 1.5, 0.3]) / 0.7)
    assert np.allclose(probs, tempered / tempered.sum(), rtol=1e-5)
    assert set(draws) <= set(allowed.tolist()) and len(set(draws)) > 1


def test_draws_follow_the_distribution_and_a_seed_repeats_them():
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal(5_000) * 2).astype(np.float32)
    params = SamplingParams(top_k=0, top_p=0.9, min_p=0.0, temperature=0.7, seed=11)
    ids, probs = distribution(logits, params, Scratch(len(logits)))
    sampler, scratch = RowSampler(params, n_ctx=256), Scratch(len(logits))
    draws = [sampler.sample(logits, [], scratch) for _ in range(20_000)]
    counts = Counter(draws)
    assert set(counts) <= set(ids.tolist())
    likely = [(i, p) for i, p in zip(ids.tolist(), probs.tolist()) if p * len(draws) >= 20]  # chi-square's cells
    observed = np.array([counts[i] for i, _ in likely] + [len(draws) - sum(counts[i] for i, _ in likely)])
    expected = np.array([p for _, p in likely] + [1 - sum(p for _, p in likely)]) * len(draws)
    assert scipy.stats.chisquare(observed, expected).pvalue > 1e-3
    again = RowSampler(params, n_ctx=256)
    assert [again.sample(logits, [], scratch) for _ in range(200)] == draws[:200]


def test_penalties_and_logit_bias_are_llama_cpps():
    rng = np.random.default_rng(9)
    logits = rng.standard_normal(2_000).astype(np.float32)
    tokens = rng.integers(0, 2_000, 300).tolist()
    params = SamplingParams(temperature=0, repeat_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.2,
                            penalty_last_n=64, logit_bias={7: 5.0, 1999: -100.0})
    adjusted = RowSampler(params, n_ctx=256).adjusted(logits, tokens, np.empty_like(logits))
    expected = reference_penalties(logits, tokens, 64, 1.3, 0.4, -0.2)
    expected[7] += 5.0
    expected[1999] -= 100.0
    assert np.allclose(adjusted, expected, atol=1e-5)
    assert RowSampler(params, n_ctx=256).sample(logits, tokens, Scratch(len(logits))) == int(expected.argmax())
    assert np.array_equal(logits, rng.__class__(rng.bit_generator.__class__(9)).standard_normal(2_000).astype(np.float32))  # the row is left as it was
