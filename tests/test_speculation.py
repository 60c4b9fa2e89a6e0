"""Speculative decoding by n-gram prompt lookup: greedy outputs identical to decoding without it
(the tiny F32 model, where a sequence's tokens do not depend on its batch), drafts actually
made and verified in the one decode per step, and drafting off where it cannot pay."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import scipy.stats

from llamabatch import BatchEngine, ConfigError, SamplingParams
from llamabatch.engine.speculation import DraftPlanner, DraftSampler, NgramLookup

PASSAGE = ("the quick brown fox jumps over the lazy dog while the small cat sleeps under the warm "
           "kitchen table and the old clock ticks on the wall ")
# Input-grounded prompts: the answer is a copy, so its n-grams are in the prompt.
PROMPTS = [f"Copy the text exactly.\nText: {PASSAGE * (1 + i % 3)}{i}\nCopy: {PASSAGE[: 10 + 7 * i]}" for i in range(10)]


def outputs(engine: BatchEngine, params, prompts: list[str] = PROMPTS) -> list[tuple]:
    """Each sequence's tokens, text, finish reason and log-probabilities (token, value, top ids)."""
    sequences = engine.submit(prompts, params)
    for _ in engine.run():
        pass
    return [(s.tokens[s.n_prompt :], s.text.text, s.finish_reason,
             [(lp.token, lp.logprob, [t for t, _ in lp.top]) for lp in s.logprobs]) for s in sequences]


def assert_same(got: list[tuple], expected: list[tuple]) -> None:
    """Tokens, texts, finish reasons and the top tokens exactly; log-probability values within
    0.02. A verified row's logits come from several query rows of one sequence at once, whose
    attention llama.cpp computes with other kernels than one row's: on this random-weight model,
    whose logits are nearly flat, the values drift by up to ~0.01 (the tokens do not move)."""
    assert [g[:3] for g in got] == [e[:3] for e in expected]
    for g, e in zip(got, expected):
        assert [(t, top) for t, _, top in g[3]] == [(t, top) for t, _, top in e[3]]
        assert all(abs(a - b) < 0.02 for (_, a, _), (_, b, _) in zip(g[3], e[3]))


@pytest.mark.parametrize("kv_unified", [True, False])
def test_greedy_output_is_identical_with_and_without_speculation(make_engine, kv_unified):
    params = [SamplingParams(temperature=0, max_tokens=24 + 5 * i, stop=("lazy cat",) if i % 4 == 1 else (),
                             logprobs=2 if i % 3 == 0 else None) for i in range(len(PROMPTS))]
    with make_engine(n_parallel=2, n_ctx=4096, kv_unified=kv_unified) as plain:
        expected = outputs(plain, params)
        assert plain.stats.draft_tokens == 0
    with make_engine(n_parallel=2, n_ctx=4096, kv_unified=kv_unified, speculative="ngram") as fast:
        assert_same(outputs(fast, params), expected)
        stats = fast.stats
    assert stats.draft_tokens > 0 and stats.draft_accepted > 0
    assert stats.completion_tokens / stats.decode_calls > 1.0  # more than a token per sequence per step somewhere


def test_drafts_never_overflow_the_batch(make_engine):
    """Four short prompts generating together, each granted 8 drafts (36 rows), with n_batch 16:
    drafts are cut to the room left beside the decode rows (without that cut the batch
    overflowed), and the output stays what decoding without them gives."""
    params = SamplingParams(temperature=0, max_tokens=200)
    prompts = [p[-60:] for p in PROMPTS[:4]]
    with make_engine(n_parallel=4, n_ctx=8192, n_batch=16) as plain:
        expected = outputs(plain, params, prompts)
    with make_engine(n_parallel=4, n_ctx=8192, n_batch=16, speculative="ngram") as fast:
        fast.planner.plan = lambda n_rows, lookups: [8] * len(lookups)
        assert_same(outputs(fast, params, prompts), expected)
        assert fast.stats.draft_tokens > 0


def test_eos_inside_an_accepted_run_ends_the_sequence_there(make_engine, tiny_eos_model):
    params = SamplingParams(temperature=0, max_tokens=40)
    with make_engine(tiny_eos_model, n_parallel=4, n_ctx=2048) as plain:
        expected = outputs(plain, params)
    with make_engine(tiny_eos_model, n_parallel=4, n_ctx=2048, speculative="ngram") as fast:
        assert_same(outputs(fast, params), expected)
    assert any(reason == "stop" for _, _, reason, _ in expected)


def lookups(*acceptance: float) -> list[NgramLookup]:
    return [NgramLookup(acceptance=a) for a in acceptance]


def teach(planner: DraftPlanner, n_rows: int, tokens_per_s: dict[bool, float], steps: int = 60) -> None:
    """Run `steps` planned steps of n_rows sequences whose speed depends on whether they draft."""
    for _ in range(steps):
        drafting = planner.plan(n_rows, lookups(*[0.9] * n_rows))[0] > 0
        planner.observe(drafting, round(tokens_per_s[drafting] * 0.1), 0.1)


def test_the_planner_drafts_at_the_batch_sizes_where_drafting_measured_faster():
    planner = DraftPlanner(draft_max=8)
    teach(planner, 1, {True: 100, False: 75})  # one sequence: drafts pay
    teach(planner, 6, {True: 150, False: 200})  # six: they cost
    assert planner.faster(1) and not planner.faster(3)
    assert [planner.plan(1, lookups(0.9))[0] for _ in range(200)].count(8) > 185  # the rest: a few trials without
    assert [planner.plan(6, lookups(*[0.9] * 6))[0] for _ in range(200)].count(0) > 185
    assert planner.plan(1, lookups(0.9, 0.1))[1] == 1  # a poor guesser drafts one token at most


def test_a_large_batch_tries_drafts_only_after_the_next_smaller_one_found_them_faster():
    planner = DraftPlanner(draft_max=8)
    teach(planner, 16, {True: 300, False: 250})
    assert (5, True) not in planner.tries  # 16 sequences, nothing known about 8 to 15: no trial at all
    teach(planner, 8, {True: 180, False: 170})  # but 8 (learnt after 4 to 7, which may try first-hand) ...
    assert not planner.faster(4)
    teach(planner, 4, {True: 120, False: 100})
    teach(planner, 8, {True: 180, False: 170})
    teach(planner, 16, {True: 300, False: 250})
    assert planner.faster(3) and planner.faster(4) and planner.faster(5)  # ... once each smaller one won


def test_constrained_and_penalised_sequences_do_not_draft(make_engine):
    constrained = SamplingParams(temperature=0, max_tokens=20, regex="[a-z ]+")
    penalised = SamplingParams(temperature=0.8, seed=3, max_tokens=20, repeat_penalty=1.3)
    with make_engine(n_parallel=2, n_ctx=4096) as plain:
        expected = [outputs(plain, constrained), outputs(plain, penalised)]
    with make_engine(n_parallel=2, n_ctx=4096, speculative="ngram") as fast:
        assert_same(outputs(fast, constrained), expected[0])
        assert_same(outputs(fast, penalised), expected[1])
        assert fast.stats.draft_tokens == 0


def test_rejection_sampling_keeps_the_target_distribution():
    """DraftSampler on fixed rows (row j is the distribution after the drafts before it): the first
    token is distributed as row 0, the second (given the first draft kept) as row 1, the bonus
    (given both kept) as row 2: chi-square goodness of fit over 20,000 verifications."""
    p = [np.array(row) for row in ([0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.6, 0.1], [0.25, 0.25, 0.25, 0.25])]
    rows = np.log(np.vstack(p)).astype(np.float32)
    draft = [1, 2]  # row 0 gives it 0.3, row 1 gives it 0.6
    sampler = DraftSampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    firsts, seconds, thirds = Counter(), Counter(), Counter()
    n = 20_000
    for _ in range(n):
        tokens, kept = sampler.verify(rows, draft)
        firsts[tokens[0]] += 1
        if tokens[0] == draft[0]:
            seconds[tokens[1]] += 1
            if tokens[1] == draft[1]:
                thirds[tokens[2]] += 1
    sampler.close()
    for counts, probs in ((firsts, p[0]), (seconds, p[1]), (thirds, p[2])):
        observed = np.array([counts[t] for t in range(4)])
        assert scipy.stats.chisquare(observed, probs * observed.sum()).pvalue > 0.001, (observed, probs)
    assert abs(firsts[1] / n - 0.3) < 0.02 and abs(seconds[2] / firsts[1] - 0.6) < 0.03  # drafts kept as often as p says


def test_sampled_sequences_draft_and_keep_their_distribution(make_engine):
    """Through the engine: sampled sequences get drafts, and their first two tokens are
    distributed as without speculation (chi-square test of homogeneity over 300 seeds each)."""
    with make_engine(n_parallel=4, n_ctx=4096) as engine:
        start = engine.tokenize_prompt("ab")
        earlier = engine.generate([start], SamplingParams(temperature=1.0, top_k=2, seed=0, max_tokens=120, ignore_eos=True))[0]
    prompt = start + earlier.token_ids + earlier.token_ids[:30]  # its own output, then its start again: drafts
    runs = {}
    for mode in ("off", "ngram"):
        with make_engine(n_parallel=4, n_ctx=4096, speculative=mode) as engine:
            if engine.planner is not None:  # draft every step, paying or not: this is about verification
                engine.planner.plan = lambda n_rows, lookups: [2] * len(lookups)
            params = [SamplingParams(temperature=1.0, top_k=2, seed=seed, max_tokens=2) for seed in range(300)]
            runs[mode] = Counter(tuple(r.token_ids) for r in engine.generate([prompt] * len(params), params))
            drafted = engine.stats.draft_tokens
    assert drafted >= 250  # nearly every sequence drafts at its first decode step
    outcomes = sorted(set(runs["off"]) | set(runs["ngram"]))
    table = np.array([[runs[m][o] for o in outcomes] for m in ("off", "ngram")])
    assert scipy.stats.chi2_contingency(table).pvalue > 0.001, (outcomes, table)


def test_lookup_proposes_what_followed_the_latest_earlier_match():
    lookup = NgramLookup()
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert lookup.propose(tokens, 4) == [7, 8, 5, 1]  # the latest earlier "1 2 3" was followed by 7 8 5 1
    assert lookup.propose(tokens + [4], 4) == []  # "2 3 4", "3 4": never seen
    lookup.record(drafted=4, accepted=4)
    assert lookup.acceptance == pytest.approx(0.8 * 0.8 + 0.2 * 1.0)  # from the prior, 0.8
    lookup.record(drafted=4, accepted=1)  # one kept, one refused: a rate of 1/2
    assert lookup.acceptance == pytest.approx(0.8 * 0.84 + 0.2 * 0.5)


def test_bad_settings_are_refused(make_engine):
    with pytest.raises(ConfigError, match="--speculative must be"):
        make_engine(speculative="medusa")
    with pytest.raises(ConfigError, match="drop --speculative"):
        make_engine(deterministic=True, speculative="ngram")
