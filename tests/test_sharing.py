"""Prompt KV shared between sequences (n samples, common prefixes) and kept in free slots,
on the tiny model, with per-sequence and unified KV caches."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llamabatch import SamplingParams

from reference import reference_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SYSTEM = "You are a terse assistant. Answer in one word, and never explain the answer. "
QUESTIONS = ["Capital of France?", "Two plus two?", "Colour of the sky?", "Opposite of cold?"]

kv_modes = pytest.mark.parametrize("kv_unified", [False, True], ids=["per-seq-kv", "unified-kv"])


def reference(engine, tiny_model, prompts: list[str]) -> list[list[int]]:
    """Each prompt decoded in full by its own sequence, without any sharing."""
    tokens = [engine.tokenize_prompt(p) for p in prompts]
    return reference_greedy(tiny_model, tokens, GREEDY.max_tokens, n_ctx=2048, n_batch=512, n_threads=2)


@kv_modes
def test_n_samples_decode_the_prompt_once(make_engine, tiny_model, kv_unified):
    engine = make_engine(n_parallel=4, kv_unified=kv_unified)
    prompt = "Once upon a time, in a land far away"
    results = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=4))
    n_prompt = len(engine.tokenize_prompt(prompt))
    assert [(r.index, r.sample) for r in results] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert engine.stats.prompt_tokens_evaluated == n_prompt
    assert engine.stats.prompt_tokens_reused == 3 * n_prompt
    expected = reference(engine, tiny_model, [prompt])[0]
    assert all(r.token_ids == expected for r in results)  # copied KV continues like the original


def test_seeded_samples_each_draw_with_their_own_seed(make_engine):
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1, min_p=0, max_tokens=12, ignore_eos=True, seed=7)
    together = make_engine(n_parallel=4).generate(["hello world"], replace(params, n=4))
    assert len({tuple(r.token_ids) for r in together}) > 1  # not four copies of one draw
    engine = make_engine(n_parallel=1)
    for k, result in enumerate(together):  # sample k == a single run seeded seed + k
        alone = engine.generate(["hello world"], replace(params, seed=7 + k))[0]
        assert alone.token_ids == result.token_ids


def test_samples_may_carry_different_parameters(make_engine):
    prompt = "The quick brown fox jumps over the lazy dog"
    params = [SamplingParams(temperature=0, max_tokens=6 + k, ignore_eos=True) for k in range(3)]
    engine = make_engine(n_parallel=3)
    results = engine.generate([prompt] * 3, params)
    assert [r.completion_tokens for r in results] == [6, 7, 8]
    assert engine.stats.prompt_tokens_evaluated == len(engine.tokenize_prompt(prompt))
    assert results[0].token_ids == results[2].token_ids[:6]


@kv_modes
def test_a_common_prefix_is_decoded_once_and_results_do_not_change(make_engine, tiny_model, kv_unified):
    engine = make_engine(n_parallel=4, kv_unified=kv_unified)
    prompts = [SYSTEM + q for q in QUESTIONS]
    results = engine.generate(prompts, GREEDY)
    lengths = [len(engine.tokenize_prompt(p)) for p in prompts]
    n_system = len(engine.tokenize_prompt(SYSTEM))
    stats = engine.stats
    assert stats.prompt_tokens_evaluated + stats.prompt_tokens_reused == sum(lengths)
    assert stats.prompt_tokens_reused >= 3 * (n_system - 2)  # the tokenizer may merge across the seam
    assert [r.token_ids for r in results] == reference(engine, tiny_model, prompts)


@kv_modes
def test_a_finished_prompt_stays_cached_for_a_later_request(make_engine, tiny_model, kv_unified):
    engine = make_engine(n_parallel=2, kv_unified=kv_unified)
    engine.generate([SYSTEM + QUESTIONS[0]], GREEDY)
    engine.reset_stats()
    later = engine.generate([SYSTEM + QUESTIONS[1]], GREEDY)[0]
    assert engine.stats.prompt_tokens_reused >= len(engine.tokenize_prompt(SYSTEM)) - 2
    assert later.token_ids == reference(engine, tiny_model, [SYSTEM + QUESTIONS[1]])[0]


def test_a_full_unified_cache_drops_cached_prefixes_before_preempting(make_engine, decode_calls):
    engine = make_engine(n_ctx=256, n_parallel=4, kv_unified=True)
    engine.generate([f"request {i} " * 4 for i in range(4)], GREEDY)  # 4 slots keep ~200 of 256 cells
    engine.reset_stats()
    decode_calls.clear()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    results = engine.generate(["a new prompt " * 6, "and another one " * 5], params)  # ~200 cells more
    assert 1 in decode_calls  # the cache really ran full
    assert all(r.completion_tokens == 20 for r in results)
    assert engine.stats.preemptions == 0  # evicting the cached prefixes made room


def test_sharing_can_be_turned_off(make_engine):
    engine = make_engine(n_parallel=4, share_prefixes=False)
    prompt = "Once upon a time, in a land far away"
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=4))
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert engine.stats.prompt_tokens_evaluated == 5 * len(engine.tokenize_prompt(prompt))
    assert engine.stats.prompt_tokens_reused == 0


@pytest.mark.parametrize("prompt", ["hi", "Once upon a time, in a land far away"], ids=["short", "long"])
def test_more_samples_than_slots_reuse_the_prompt_from_a_finished_slot(make_engine, prompt):
    engine = make_engine(n_parallel=4)
    results = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=8))
    assert len(results) == 8 and all(r.completion_tokens == 5 for r in results)
    # the first wave decodes the prompt once; the second takes it from a finished slot's cache
    # and decodes only its last token again, for the logits
    assert engine.stats.prompt_tokens_evaluated == len(engine.tokenize_prompt(prompt)) + 1


@kv_modes
def test_a_follower_of_a_follower_gets_its_shorter_prefix_when_the_middle_one_gets_its_own(
    make_engine, tiny_model, kv_unified
):
    """C prefills; A shares 9 tokens with C and follows it; B shares only 8 (C already holds 8,
    so B follows A). When C reaches 9, A's copy lands past B's 8: B must get its 8 from A then,
    not leave A with a negative chunk (this once overflowed the batch)."""
    engine = make_engine(n_parallel=4, n_batch=8, kv_unified=kv_unified)
    vocab = engine.vocab
    base = engine.tokenize_prompt("the capital of France is Paris and the capital of Paris is France")
    assert len(base) > 12
    c = list(base)
    a = base[:9] + vocab.tokenize(" hello world", add_special=False)
    b = base[:8] + vocab.tokenize(" once upon a time", add_special=False)
    assert a[8] != b[8] and a[:9] == c[:9]
    engine.add(c, GREEDY)
    engine.step()  # C prefills its first n_batch = 8 tokens
    [seq_a] = engine.add(a, GREEDY)
    [seq_b] = engine.add(b, GREEDY)
    results = {seq.uid: seq for seq in (seq_a, seq_b)}
    for _ in engine.run():
        pass
    assert engine.stats.prompt_tokens_reused >= 9 + 8
    expected = reference_greedy(tiny_model, [a, b], GREEDY.max_tokens, n_ctx=2048, n_batch=512, n_threads=2)
    assert [results[seq_a.uid].tokens[len(a):], results[seq_b.uid].tokens[len(b):]] == expected
