"""Prompt log-probabilities and BatchEngine.score on the tiny model, against a reference loop
written straight against llama_cpp (each text decoded alone, logits on every row)."""

from __future__ import annotations

import math

import pytest

from llamabatch import SamplingParams
from llamabatch.engine.scoring import scored_prompts
from llamabatch.engine.scheduling.scheduler import Scheduler
from llamabatch.engine.sequence import Sequence

from reference import reference_prompt_logprobs

TEXTS = ["the capital of France is Paris", "Once upon a time in a land far away", "def fib(n): return n"]


@pytest.fixture(params=[False, True], ids=["per-seq-kv", "unified-kv"])
def kv_unified(request) -> bool:
    return request.param


def close(kv_unified: bool) -> dict:
    """How near the reference (each text decoded alone): exact to F32 rounding with a cache per
    sequence; within 1e-3 relative in a unified cache, where attention also spans other sequences'
    (masked) cells and sums in another order. A token scored at a wrong position is off by units."""
    return {"rel": 1e-3, "abs": 2e-2} if kv_unified else {"abs": 1e-3}


def test_prompt_logprobs_equal_the_reference_and_come_with_alternatives(make_engine, tiny_model, kv_unified):
    engine = make_engine(n_parallel=3, kv_unified=kv_unified)
    seqs = engine.submit(TEXTS, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, ignore_eos=True))
    for _ in engine.run():
        pass
    for seq in seqs:
        expected = reference_prompt_logprobs(tiny_model, seq.tokens[: seq.n_prompt])
        got = seq.scored.tokens
        assert [lp.token for lp in got] == seq.tokens[1 : seq.n_prompt]  # every prompt token after the first
        assert [lp.logprob for lp in got] == pytest.approx([lp for lp, _ in expected], **close(kv_unified))
        assert all(len(lp.top) == 3 and lp.top[0][1] >= lp.logprob - 1e-9 for lp in got)
        assert seq.scored.logprob == pytest.approx(sum(lp for lp, _ in expected), **close(kv_unified))
        assert seq.n_generated == 2  # and it still generates


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(make_engine, tiny_model, kv_unified):
    engine = make_engine(kv_unified=kv_unified)
    [seq] = engine.add("hello world and the capital", SamplingParams(max_tokens=0, prompt_logprobs=0))
    [plain] = engine.add("hello world", SamplingParams(max_tokens=0))
    assert plain.finish_reason == "length" and plain.n_past == 0  # nothing to do: never queued
    events = [e for e in engine.run()]
    assert [e.finish_reason for e in events] == ["length"] and seq.n_generated == 0
    expected = reference_prompt_logprobs(tiny_model, seq.tokens)
    assert seq.scored.n_tokens == len(seq.tokens) - 1
    assert seq.scored.logprob == pytest.approx(sum(lp for lp, _ in expected), **close(kv_unified))


def test_score_pairs_sums_the_continuation_and_says_if_it_was_greedy(make_engine, tiny_model, kv_unified):
    engine = make_engine(n_parallel=4, kv_unified=kv_unified)
    context = "Question: what is the capital of France? Answer:"
    choices = [" Paris", " the", " hello world", " a"]
    scores = engine.score([(context, c) for c in choices])
    for (context_, choice), score in zip([(context, c) for c in choices], scores):
        [(tokens, first)] = scored_prompts(engine.vocab, (context_, choice), True, None)
        expected = reference_prompt_logprobs(tiny_model, tokens)[first - 1 :]
        assert score.n_tokens == len(tokens) - first == len(expected)
        assert score.logprob == pytest.approx(sum(lp for lp, _ in expected), **close(kv_unified))
        assert score.greedy == all(g for _, g in expected)
        assert score.perplexity == pytest.approx(math.exp(-score.logprob / score.n_tokens))
    # The context is decoded once and copied: four choices do not cost four contexts.
    n_context = len(engine.tokenize_prompt(context))
    assert engine.stats.prompt_tokens_reused >= 3 * (n_context - 1)


def test_a_greedy_continuation_is_reported_greedy_and_another_is_not(make_engine):
    engine = make_engine()
    prompt = engine.tokenize_prompt("the capital of France is")
    greedy = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids
    other = greedy[:2] + [(greedy[2] + 1) % engine.vocab.n_vocab] + greedy[3:]
    [a] = engine.add(prompt + greedy, SamplingParams(max_tokens=0), score_from=len(prompt))
    [b] = engine.add(prompt + other, SamplingParams(max_tokens=0), score_from=len(prompt))
    for _ in engine.run():
        pass
    assert (a.scored.greedy, a.scored.n_tokens) == (True, 4)
    assert (b.scored.greedy, b.scored.n_tokens) == (False, 4) and b.scored.logprob < a.scored.logprob


def test_texts_and_llama_perplexity_windows(make_engine, tiny_model, kv_unified):
    engine = make_engine(n_parallel=4, n_ctx=4096, kv_unified=kv_unified)
    text = " ".join(["the capital of France is Paris and Paris is the capital of France"] * 12)
    whole, windowed = engine.score([text, text], chunk=None)[0], engine.score([text], chunk=64)[0]
    tokens = engine.vocab.tokenize(text)
    expected = reference_prompt_logprobs(tiny_model, tokens)
    assert whole.n_tokens == len(tokens) - 1
    assert whole.logprob == pytest.approx(sum(lp for lp, _ in expected), rel=1e-4 if kv_unified else 1e-5)
    # llama-perplexity: full 64-token windows, BOS first, the second half of each scored
    windows = scored_prompts(engine.vocab, text, True, 64)
    assert len(windows) == len(tokens) // 64
    assert all(w[0] == engine.vocab.bos and len(w) == 64 and first == 33 for w, first in windows)
    assert windowed.n_tokens == len(windows) * 31
    total = 0.0
    for window, first in windows:
        total += sum(lp for lp, _ in reference_prompt_logprobs(tiny_model, window)[first - 1 :])
    assert windowed.logprob == pytest.approx(total, rel=1e-4 if kv_unified else 1e-5)


def test_bad_items_fail_alone(make_engine):
    engine = make_engine(n_ctx=1024, n_parallel=4)
    scores = engine.score(["hello world", ("hello", ""), "word " * 400, ("the capital", " of France")])
    assert scores[0].error is None and scores[3].error is None and scores[3].n_tokens > 0
    assert "empty continuation" in scores[1].error and "longer than" in scores[2].error
    assert [s.index for s in scores] == [0, 1, 2, 3]


def test_scored_chunks_keep_to_the_logits_budget():
    """A scored prompt's chunk holds no more scored rows than the step has logits rows left."""
    sched = Scheduler(n_slots=2, n_batch=512, max_outputs=16)
    seq = Sequence(0, "", SamplingParams(max_tokens=0), list(range(200)), 200, score_from=50)
    sched.add(seq)
    sched.admit()
    chunks = []
    while seq.n_past < 200:
        step = sched.schedule()
        [n] = step.chunks
        chunks.append(n)
        assert len(seq.scored_rows(seq.n_past, n)) <= 16
        seq.advance(n)
    assert chunks[0] == 49 + 16  # the unscored rows before position 49 are free
    assert set(chunks[1:-1]) == {16}
