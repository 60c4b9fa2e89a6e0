"""Speculative decoding, by n-gram prompt lookup and by a draft model: greedy outputs identical to
decoding without it (the tiny F32 model, where a sequence's tokens do not depend on its batch),
sampled ones keeping their distribution, drafts actually made and verified in the one decode per
step, and drafting off where it cannot pay."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import scipy.stats

from llamabatch import BatchEngine, ConfigError, ModelError, SamplingParams
from llamabatch.engine.speculative.planner import DraftPlanner, DraftState, draft_length
from llamabatch.engine.speculative.rejection import DraftSampler
from llamabatch.engine.speculative.ngrams import NgramIndex
from llamabatch.engine.sampling.truncation import Scratch

from tiny_model import WORD_PIECES, write_tiny_model

PASSAGE = ("the quick brown fox jumps over the lazy dog while the small cat sleeps under the warm "
           "kitchen table and the old clock ticks on the wall ")
# Input-grounded prompts: the answer is a copy, so its n-grams are in the prompt.
PROMPTS = [f"Copy the text exactly.\nText: {PASSAGE * (1 + i % 3)}{i}\nCopy: {PASSAGE[: 10 + 7 * i]}" for i in range(10)]


def outputs(engine: BatchEngine, params, prompts: list[str] = PROMPTS) -> list[tuple]:
    """Each sequence's tokens, text, finish reason and log-probabilities (token, value, top ids)."""
    sequences = engine.submit(prompts, params)
    for _ in engine.run():
        pass
    return [(s.tokens[s.n_prompt :], s.text, s.finish_reason,
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
        fast.speculator.planner.plan = lambda n_rows, states: [8] * len(states)
        assert_same(outputs(fast, params, prompts), expected)
        assert fast.stats.draft_tokens > 0


def test_eos_inside_an_accepted_run_ends_the_sequence_there(make_engine, tiny_eos_model):
    params = SamplingParams(temperature=0, max_tokens=40)
    with make_engine(tiny_eos_model, n_parallel=4, n_ctx=2048) as plain:
        expected = outputs(plain, params)
    with make_engine(tiny_eos_model, n_parallel=4, n_ctx=2048, speculative="ngram") as fast:
        assert_same(outputs(fast, params), expected)
    assert any(reason == "stop" for _, _, reason, _ in expected)


def states(*acceptance: float) -> list[DraftState]:
    return [DraftState(acceptance=a) for a in acceptance]


def teach(planner: DraftPlanner, n_rows: int, tokens_per_s: dict[bool, float], steps: int = 60) -> None:
    """Run `steps` planned steps of n_rows sequences whose speed depends on whether they draft."""
    for _ in range(steps):
        drafting = planner.plan(n_rows, states(*[0.9] * n_rows))[0] > 0
        planner.observe(drafting, round(tokens_per_s[drafting] * 0.1), 0.1)


def test_the_planner_drafts_at_the_batch_sizes_where_drafting_measured_faster():
    planner = DraftPlanner(draft_max=8)
    teach(planner, 1, {True: 100, False: 75})  # one sequence: drafts pay
    teach(planner, 6, {True: 150, False: 200})  # six: they cost
    assert planner.faster(1) and not planner.faster(3)
    assert [planner.plan(1, states(0.9))[0] for _ in range(200)].count(8) > 185  # the rest: a few trials without
    assert [planner.plan(6, states(*[0.9] * 6))[0] for _ in range(200)].count(0) > 185
    assert planner.plan(1, states(0.9, 0.6, 0.1)) == [8, 3, 1]  # draft lengths follow each one's acceptance


def test_costly_drafting_is_dropped_after_two_tries_and_seldom_tried_again():
    """A draft model's step takes 50 times a plain one and gives a fifth of its rate: two tries
    decide (the margin is over 2x), and trying again takes at most 3% of the time, not of the steps."""
    planner = DraftPlanner(draft_max=8)
    seconds = {True: 0.5, False: 0.01}
    tokens = {True: 10, False: 1}  # 20 against 100 tokens/s
    chosen = []
    for _ in range(20_000):
        drafting = planner.plan(1, states(0.9))[0] > 0
        chosen.append(drafting)
        planner.observe(drafting, tokens[drafting], seconds[drafting])
    assert chosen[:4].count(True) == 2 and chosen[4:].count(True) < 40
    time_drafting = chosen[4:].count(True) * seconds[True]
    assert time_drafting / (time_drafting + chosen[4:].count(False) * seconds[False]) < 0.06


def test_setup_time_is_left_out_of_the_rate_but_not_out_of_a_step_cost():
    """A draft model decoding a new prompt (setup) does it once a sequence: the way's rate leaves
    it out, the time a try of that way takes keeps it."""
    planner = DraftPlanner(draft_max=8)
    planner.plan(1, states(0.9))
    planner.observe(True, 10, 1.0, setup=0.8)
    assert planner.rate(1, True) == pytest.approx(10 / 0.2) and planner.step_seconds(1, True) == pytest.approx(1.0)


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
    sampler = DraftSampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), np.random.default_rng(7))
    scratch = Scratch(4)
    firsts, seconds, thirds = Counter(), Counter(), Counter()
    n = 20_000
    for _ in range(n):
        tokens, kept = sampler.verify(rows, draft, scratch)
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


def sampled_outcomes(engine: BatchEngine, prompt: str | list[int]) -> Counter:
    """The three tokens of 300 seeds, sampled four sequences at a time: after their prompt every
    step is a pure decode step, where drafts go (each drafting its second token: two draft rows
    are forced on every step, and max_tokens leaves room for one)."""
    if engine.speculator is not None:  # draft every step, paying or not: this is about verification
        engine.speculator.planner.plan = lambda n_rows, states: [2] * len(states)
    params = [SamplingParams(temperature=1.0, top_k=2, seed=seed, max_tokens=3) for seed in range(300)]
    counts = Counter()
    for i in range(0, len(params), 4):
        counts.update(tuple(r.token_ids) for r in engine.generate([prompt] * 4, params[i : i + 4]))
    return counts


def test_sampled_sequences_draft_and_keep_their_distribution(make_engine):
    """Through the engine: sampled sequences get drafts, and their first three tokens are
    distributed as without speculation (chi-square test of homogeneity over 300 seeds each)."""
    with make_engine(n_parallel=4, n_ctx=4096) as engine:
        start = engine.tokenize_prompt("ab")
        earlier = engine.generate([start], SamplingParams(temperature=1.0, top_k=2, seed=0, max_tokens=120, ignore_eos=True))[0]
    prompt = start + earlier.token_ids + earlier.token_ids[:30]  # its own output, then its start again: drafts
    runs = {}
    for mode in ("off", "ngram"):
        with make_engine(n_parallel=4, n_ctx=4096, speculative=mode) as engine:
            runs[mode] = sampled_outcomes(engine, prompt)
            drafted = engine.stats.draft_tokens
    assert drafted >= 250  # nearly every sequence drafts at its first decode step
    outcomes = sorted(set(runs["off"]) | set(runs["ngram"]))
    table = np.array([[runs[m][o] for o in outcomes] for m in ("off", "ngram")])
    assert scipy.stats.chi2_contingency(table).pvalue > 0.001, (outcomes, table)


def test_lookup_proposes_what_followed_the_latest_earlier_match():
    index = NgramIndex()
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert index.propose(tokens, 4) == [7, 8, 5, 1]  # the latest earlier "1 2 3" was followed by 7 8 5 1
    assert index.propose(tokens + [4], 4) == []  # "2 3 4", "3 4": never seen


def test_acceptance_rate_and_draft_length():
    state = DraftState()
    state.record(drafted=4, accepted=4)
    assert state.acceptance == pytest.approx(0.8 * 0.8 + 0.2 * 1.0)  # from the prior, 0.8
    state.record(drafted=4, accepted=1)  # one kept, one refused: a rate of 1/2
    assert state.acceptance == pytest.approx(0.8 * 0.84 + 0.2 * 0.5)
    # positions reached with a chance of at least 0.2: 0.9**15 = 0.206, 0.6**3 = 0.216, 0.5**2 = 0.25
    assert [draft_length(a, 16) for a in (1.0, 0.9, 0.6, 0.5, 0.3, 0.0)] == [16, 15, 3, 2, 1, 1]


def test_bad_settings_are_refused(make_engine):
    with pytest.raises(ConfigError, match="--speculative must be"):
        make_engine(speculative="medusa")
    with pytest.raises(ConfigError, match="drop --speculative"):
        make_engine(deterministic=True, speculative="ngram")


# -- drafts from a draft model -------------------------------------------------------------


@pytest.fixture(scope="module")
def other_tiny_model(tmp_path_factory):
    """Same vocabulary as the tiny model, other random weights: a draft model that is often wrong."""
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "tiny-seed1.gguf", seed=1)


@pytest.mark.parametrize("draft", ["same", "other"])
def test_greedy_output_is_identical_with_a_draft_model(make_engine, tiny_model, other_tiny_model, draft):
    """The target as its own draft (nearly every draft kept) and another model of the same
    vocabulary (most refused): outputs equal decoding without speculation either way, with more
    prompts than slots, so slots and their draft KV pass from sequence to sequence."""
    draft_model = tiny_model if draft == "same" else other_tiny_model
    params = [SamplingParams(temperature=0, max_tokens=20 + 3 * i, logprobs=2 if i % 3 == 0 else None) for i in range(len(PROMPTS))]
    with make_engine(n_parallel=3, n_ctx=4096) as plain:
        expected = outputs(plain, params)
    with make_engine(n_parallel=3, n_ctx=4096, draft_model=draft_model) as fast:
        assert fast.config.speculative == "draft"  # naming a draft model turns it on
        fast.speculator.planner.plan = lambda n_rows, states: [4] * len(states)  # draft every step: this is about exactness
        assert_same(outputs(fast, params), expected)
        stats = fast.stats
    kept = stats.draft_accepted / stats.draft_tokens
    print(f"draft {draft}: {stats.draft_tokens} drafted, {kept:.2f} kept, "
          f"{stats.completion_tokens / stats.decode_calls:.2f} tokens per target decode")
    if draft == "same":
        assert kept > 0.9 and stats.completion_tokens / stats.decode_calls > 2.5
    else:
        assert stats.draft_tokens > 100 and kept < 0.5


def test_sampled_drafts_from_a_draft_model_keep_the_distribution(make_engine, tiny_model):
    """Greedy drafts are certain proposals, so rejection sampling keeps a sampled sequence's
    distribution: its first three tokens over 300 seeds match decoding without speculation."""
    runs = {}
    for mode in ("off", "draft"):
        with make_engine(n_parallel=4, n_ctx=4096, draft_model=tiny_model if mode == "draft" else None) as engine:
            runs[mode] = sampled_outcomes(engine, "The capital of France is")
            drafted, kept = engine.stats.draft_tokens, engine.stats.draft_accepted
    assert drafted >= 300 and kept > 0
    outcomes = sorted(set(runs["off"]) | set(runs["draft"]))
    table = np.array([[runs[m][o] for o in outcomes] for m in ("off", "draft")])
    assert scipy.stats.chi2_contingency(table).pvalue > 0.001, (outcomes, table)


def test_a_draft_model_with_another_vocabulary_is_refused(make_engine, tmp_path):
    pieces = [f"▁w{i}" for i in range(200)]  # 169 more tokens than the target
    foreign = write_tiny_model(tmp_path / "foreign.gguf", pieces=pieces)
    with pytest.raises(ModelError, match=r"does not share the target's vocabulary: .*tokens vs the target's") as e:
        make_engine(draft_model=foreign)
    print(e.value)
    same_size = write_tiny_model(tmp_path / "same-size.gguf", pieces=[p + "x" for p in WORD_PIECES])
    with pytest.raises(ModelError, match=r"token 259 is '▁thex', the target's is '▁the'"):
        make_engine(draft_model=same_size)
    with pytest.raises(ModelError, match="GGUF file not found"):
        make_engine(draft_model=tmp_path / "missing.gguf")


def test_draft_settings_are_checked(make_engine, tiny_model):
    with pytest.raises(ConfigError, match="--speculative draft needs --draft-model"):
        make_engine(speculative="draft")
    with pytest.raises(ConfigError, match="--draft-model drafts with --speculative draft, not 'ngram'"):
        make_engine(speculative="ngram", draft_model=tiny_model)


def test_a_full_draft_context_gives_no_drafts_and_recovers(tiny_model):
    """The draft model's context fills up (three 100-token sequences in 256 cells): that step gets
    no drafts instead of an error, the context is emptied, and the next step drafts again."""
    from llamabatch.engine.speculative.drafters import DraftModel
    from llamabatch.engine.native.handles import Model
    from llamabatch.engine.sequence import Sequence

    with Model(tiny_model) as target:
        drafter = DraftModel(tiny_model, target.vocab, n_ctx=256, n_batch=64, n_seq_max=3, n_threads=2, gpu_layers=0)
        try:
            assert drafter.ctx.n_ctx == 256
            sequences = [Sequence(i, "", SamplingParams(), [1] + [100 + i + j % 50 for j in range(99)], 100, seq_id=i)
                         for i in range(3)]
            assert drafter.propose(sequences, [4, 4, 4]) == [[], [], []]
            assert drafter.held == {}
            drafts = drafter.propose(sequences[:1], [4])
            assert len(drafts[0]) == 4 and len(drafter.held[0]) == 100 + 3  # its tokens, and all drafts but the last
        finally:
            drafter.close()
