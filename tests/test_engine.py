"""BatchEngine on a tiny generated model: real llama.cpp contexts, batches and samplers."""

from __future__ import annotations

import itertools
import math
import sys
from collections import Counter
from dataclasses import replace

import llama_cpp
import pytest

from llamabatch import PromptError, SamplingParams
from llamabatch.engine import batch_engine
from llamabatch.engine.native.backend import GGML_LOG_LEVEL_WARN, MAX_KEPT_WARNINGS, log
from llamabatch.engine.native.handles import POSITIONS_AHEAD

from reference import batch_seq_ids, reference_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["hello world", "the capital of France is", "Once upon a time", "def fib(n):",
           "a", "and the", "to be or not", "Paris"]


@pytest.mark.parametrize("n_seqs", [1, 3, 8])
def test_one_decode_call_per_step_whatever_the_number_of_sequences(make_engine, decode_calls, n_seqs):
    engine = make_engine(n_parallel=8)
    engine.submit(PROMPTS[:n_seqs], GREEDY)
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    # step 1 prefills every prompt and samples token 1; each later step adds one token to all
    assert steps == GREEDY.max_tokens
    assert len(decode_calls) == steps == engine.stats.decode_calls
    assert engine.stats.mean_active_sequences == n_seqs
    assert engine.stats.completion_tokens == n_seqs * GREEDY.max_tokens
    engine.reset_stats()  # a fresh count for the next run
    assert engine.stats.decode_calls == engine.stats.completion_tokens == 0


def test_batch_rows_hold_positions_seq_ids_and_logits_flags(make_engine):
    engine = make_engine(n_parallel=3, n_batch=16)
    lengths = [len(engine.tokenize_prompt(p)) for p in ("hello world", "a", "Once upon a time")]
    assert lengths[0] + lengths[1] < 16 < sum(lengths)  # the third prompt must be split
    a, b, c = engine.submit(["hello world", "a", "Once upon a time"], GREEDY)

    engine.step()
    batch = engine.batch
    n_c = 16 - lengths[0] - lengths[1]
    assert batch.n_tokens == 16
    assert batch_seq_ids(batch) == [a.seq_id] * lengths[0] + [b.seq_id] * lengths[1] + [c.seq_id] * n_c
    assert list(batch.pos[:16]) == [*range(lengths[0]), *range(lengths[1]), *range(n_c)]
    assert list(batch.token[:16]) == a.tokens[: lengths[0]] + b.tokens[: lengths[1]] + c.tokens[:n_c]
    flagged = [lengths[0] - 1, lengths[0] + lengths[1] - 1]  # c is mid-prompt: no logits yet
    assert [i for i in range(16) if batch.logits[i]] == flagged
    assert (a.n_generated, b.n_generated, c.n_generated) == (1, 1, 0)  # each from its own row's logits

    engine.step()
    # a and b decode their first sampled token; c goes on with its prompt after them
    rest = min(lengths[2] - n_c, 16 - 2)
    c_done = n_c + rest == lengths[2]
    assert batch.n_tokens == 2 + rest
    assert batch_seq_ids(batch) == [a.seq_id, b.seq_id] + [c.seq_id] * rest
    assert list(batch.pos[: 2 + rest]) == [lengths[0], lengths[1], *range(n_c, n_c + rest)]
    assert list(batch.token[:2]) == [a.tokens[lengths[0]], b.tokens[lengths[1]]]
    assert [i for i in range(2 + rest) if batch.logits[i]] == [0, 1] + ([1 + rest] if c_done else [])


@pytest.mark.parametrize("n_seqs", [1, 3])
def test_a_repeating_plain_step_gives_llama_cpp_each_rows_next_position(make_engine, n_seqs):
    """A plain step handed over again writes only its new tokens; its positions were written
    ahead, POSITIONS_AHEAD steps at a time. Through more than two such spans, each row llama.cpp
    reads holds its sequence's newest token at the position after the one before."""
    engine = make_engine(n_parallel=n_seqs)
    steps = 2 * POSITIONS_AHEAD + 9
    sequences = engine.submit(PROMPTS[:n_seqs], SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # the prompts
    batch = engine.batch.handle  # the struct llama_decode is handed
    for _ in range(steps):
        engine.step()
        assert batch.n_tokens == n_seqs
        assert [batch.pos[i] for i in range(n_seqs)] == [s.n_past - 1 for s in sequences]
        assert [batch.token[i] for i in range(n_seqs)] == [s.tokens[s.n_past - 1] for s in sequences]
    assert [s.finish_reason for s in sequences] == ["length"] * n_seqs and engine.stats.failed_decodes == 0


@pytest.mark.parametrize("warned_before", [0, 2 * MAX_KEPT_WARNINGS])
def test_memory_changed_behind_a_repeating_plain_step_fails_its_sequence_alone(make_engine, warned_before):
    """The positions a repeating plain step hands llama.cpp are the engine's own, which llama.cpp
    checks against its memory: one sequence's memory overwritten by another's mid-run fails that
    sequence at once, named by llama.cpp, and the others run to their ends. However many
    warnings the process logged before (more than the log keeps), llama.cpp's reason is the one
    its refusal gave."""
    for _ in range(warned_before):
        log.write(GGML_LOG_LEVEL_WARN, "an earlier warning\n")
    engine = make_engine(n_parallel=4)
    sequences = engine.submit(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(8):
        engine.step()
    victim, longer = sequences[0], sequences[1]
    assert longer.n_past > victim.n_past
    llama_cpp.llama_memory_seq_cp(llama_cpp.llama_get_memory(engine.ctx.handle), longer.seq_id, victim.seq_id, -1, -1)
    while engine.has_work:
        engine.step()
    assert victim.finish_reason == "error" and "inconsistent sequence positions" in victim.error, victim.error
    assert engine.stats.failed_decodes == 1 and engine.stats.failed_steps == 0
    assert [s.finish_reason for s in sequences if s is not victim] == ["length"] * 3


def test_a_prompt_chunk_cut_to_one_token_asks_for_no_logits(make_engine, tiny_model):
    """Three sequences decode while a long prompt gets the one token left of n_batch = 4 each
    step: those one-token chunks are prompt, not a decode, until the prompt's last token."""
    engine = make_engine(n_parallel=4, n_batch=4, n_ubatch=4)
    short = engine.submit(["a", "the", "and the"], GREEDY)
    for _ in range(3):  # the three short prompts are in and decoding
        engine.step()
    long_prompt = engine.tokenize_prompt("Once upon a time in a land far away")
    [seq] = engine.add(long_prompt, GREEDY)
    one_token_chunks = 0
    while seq.t_first_token is None:
        engine.step()
        rows = batch_seq_ids(engine.batch)
        if rows.count(seq.seq_id) == 1:
            one_token_chunks += 1
            assert bool(engine.batch.logits[rows.index(seq.seq_id)]) == (seq.n_past == len(long_prompt))
    assert one_token_chunks >= 3 and all(s.n_generated > 0 for s in short)
    while engine.has_work:
        engine.step()
    expected = reference_greedy(tiny_model, [long_prompt], GREEDY.max_tokens, n_ctx=2048, n_batch=512, n_threads=2)
    assert seq.tokens[len(long_prompt):] == expected[0]


def test_engine_matches_a_reference_loop_written_against_llama_cpp(make_engine, tiny_model):
    engine = make_engine(n_parallel=len(PROMPTS), n_batch=256, n_ubatch=256, n_ctx=2048)
    results = engine.generate(PROMPTS, GREEDY)
    expected = reference_greedy(
        tiny_model, [engine.tokenize_prompt(p) for p in PROMPTS], GREEDY.max_tokens,
        n_ctx=2048, n_batch=256, n_threads=2,
    )
    assert [r.token_ids for r in results] == expected


def test_first_greedy_token_in_a_batch_equals_a_solo_run(make_engine):
    batched = make_engine(n_parallel=8).generate(PROMPTS, GREEDY)
    solo_engine = make_engine(n_parallel=1)
    for prompt, result in zip(PROMPTS, batched):
        assert solo_engine.generate([prompt], GREEDY)[0].token_ids[0] == result.token_ids[0]


def test_more_prompts_than_slots_all_complete_exactly_once(make_engine):
    engine = make_engine(n_parallel=8, n_ctx=4096)
    prompts = [f"{PROMPTS[i % 8]} {i}" for i in range(200)]
    params = [SamplingParams(temperature=0, max_tokens=2 + i % 7, ignore_eos=True) for i in range(200)]
    finished = Counter()
    seqs = engine.submit(prompts, params)
    for event in engine.run():
        if event.finish_reason:
            finished[event.index] += 1
    assert finished == Counter(range(200))
    results = [s.result() for s in seqs]
    assert [r.index for r in results] == list(range(200))
    assert [r.completion_tokens for r in results] == [p.max_tokens for p in params]
    assert all(r.finish_reason == "length" for r in results)
    assert engine.stats.mean_active_sequences > 7  # slots were refilled as sequences left
    assert not engine.has_work


def test_stop_string_cuts_the_text_exactly(make_engine):
    engine = make_engine()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = engine.generate(["hello world"], params)[0].text
    stop = next(full[i : i + 2] for i in range(6, len(full) - 2) if full.find(full[i : i + 2]) == i)
    events = list(engine.stream(["hello world"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=(stop,))))
    cut = full[: full.index(stop)]
    assert events[-1].finish_reason == "stop"
    assert "".join(e.text for e in events) == cut
    assert engine.generate(["hello world"], SamplingParams(**{**params.__dict__, "stop": (stop,)}))[0].text == cut


def test_streamed_text_equals_the_final_text(make_engine):
    engine = make_engine()
    seqs = engine.submit(PROMPTS[:4], SamplingParams(temperature=0.9, seed=3, max_tokens=30))
    deltas: dict[int, str] = {}
    for event in engine.run():
        deltas[event.index] = deltas.get(event.index, "") + event.text
    for seq in seqs:
        assert deltas[seq.index] == seq.result().text


def test_utf8_characters_split_across_tokens_stream_whole(make_engine):
    engine = make_engine()
    text = "héllo wörld 世界 🎉"
    tokens = engine.vocab.tokenize(text, add_special=False)
    pieces = [engine.vocab.piece(t) for t in tokens]
    assert any(_invalid_utf8(p) for p in pieces)  # the vocabulary really splits characters
    from llamabatch.engine.text import TextStream

    stream = TextStream()
    deltas = [stream.push(p) for p in pieces] + [stream.finish()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas).strip() == text


def test_end_of_generation_token_finishes_with_stop(make_engine, tiny_eos_model):
    engine = make_engine(tiny_eos_model)
    result = engine.generate(["hello"], SamplingParams(temperature=0, max_tokens=10))[0]
    assert (result.finish_reason, result.completion_tokens, result.text) == ("stop", 1, "")
    ignored = engine.generate(["hello"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert (ignored.finish_reason, ignored.completion_tokens) == ("length", 10)


def test_same_seed_and_batch_give_the_same_output(make_engine):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, ignore_eos=True) for s in (7, 7, 8, 9)]
    first = [r.token_ids for r in make_engine().generate(PROMPTS[:4], params)]
    second = [r.token_ids for r in make_engine().generate(PROMPTS[:4], params)]
    assert first == second
    other = [r.token_ids for r in make_engine().generate(PROMPTS[:4], SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True))]
    assert other != first


def test_sampled_rows_drawn_on_several_threads_are_the_rows_drawn_on_one(make_engine):
    """The picker shares a step's sampled rows out between threads (each row's draw is its own
    sampler's): the tokens are those one thread draws, and a sampler that raises fails its own
    sequence only, on whichever thread it ran: at once (its prompt's step), or after three draws
    (in a plain step, whose tokens are accepted apart)."""
    from llamabatch.engine.sampling.picker import Picker

    kinds = [SamplingParams(temperature=0.9, top_p=0.9, top_k=0), SamplingParams(temperature=1.2, repeat_penalty=1.3),
             SamplingParams(temperature=0.7, typical_p=0.8), SamplingParams(temperature=0.8, min_p=0.1)]  # typical_p: llama.cpp's chain
    params = [replace(kinds[i % 4], seed=i, max_tokens=16, ignore_eos=True) for i in range(12)]
    runs = []
    for n_threads in (1, 3):
        engine = make_engine(n_parallel=12, n_ctx=12 * 256)
        engine.picker.close()
        engine.picker = engine.stepper.picker = Picker(engine.grammars, engine.runtime.scratch, n_threads)
        sequences = engine.submit([f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(12)], params)
        sequences[5].sampler.sample = lambda *args: 1 / 0  # noqa: ARG005 - its draw fails, at once
        later, draws = sequences[7].sampler, itertools.count()
        later.sample = lambda *args, draw=later.sample: draw(*args) if next(draws) < 3 else 1 / 0
        while engine.has_work:
            engine.step()
        assert engine.scheduler.n_sampled == 0  # counted in as each was admitted, out as each ended
        runs.append([(s.tokens[s.n_prompt:], s.finish_reason, s.error) for s in sequences])
    assert runs[0] == runs[1]
    assert runs[0][5][:2] == ([], "error") and len(runs[0][7][0]) == 3 and runs[0][7][1] == "error"
    assert "sampling failed: ZeroDivisionError" in runs[0][7][2]
    assert all(reason == "length" for i, (_, reason, _) in enumerate(runs[0]) if i not in (5, 7))


def test_a_plain_greedy_step_picks_the_argmax_as_a_step_with_special_rows_does(make_engine):
    """A step whose rows are all plain greedy takes its picks from one argmax over the logits,
    skipping the picker's passes over the rows; a step with a sequence that reports
    log-probabilities (a special one) goes the general way. The same batch both ways gives the
    same tokens, and the counts the shortcut is chosen by return to 0."""
    runs = []
    for logprobs in (None, 2):
        engine = make_engine(n_parallel=4)
        params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3
        params.append(SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=logprobs))  # ends first
        sequences = engine.submit(PROMPTS[:4], params)
        while engine.has_work:
            engine.step()
        assert (engine.scheduler.n_special, engine.scheduler.n_sampled) == (0, 0)
        assert len(sequences[3].logprobs) == (5 if logprobs else 0)
        runs.append([s.tokens[s.n_prompt:] for s in sequences])
    assert runs[0] == runs[1]


def test_top_k_one_samples_the_greedy_token(make_engine):
    engine = make_engine()
    greedy = engine.generate(PROMPTS[:4], GREEDY)
    top1 = engine.generate(PROMPTS[:4], SamplingParams(temperature=1.5, top_k=1, seed=5, max_tokens=12, ignore_eos=True))
    assert [r.token_ids for r in top1] == [r.token_ids for r in greedy]


def test_repeat_penalty_covers_prompt_and_output(make_engine):
    engine = make_engine()
    params = SamplingParams(temperature=0, repeat_penalty=1e6, penalty_last_n=-1, max_tokens=20, ignore_eos=True)
    seq = engine.submit(["hello world"], params)[0]
    list(engine.run())
    generated = seq.tokens[seq.n_prompt :]
    assert len(set(generated)) == len(generated)
    assert not set(generated) & set(seq.tokens[: seq.n_prompt])


def test_a_bad_prompt_fails_alone(make_engine):
    engine = make_engine(n_ctx=512, n_parallel=2)  # a unified cache: one sequence may use all 512 cells
    results = engine.generate(["hello", "", "word " * 300, "world", [1, 2, 10**7]], GREEDY)
    assert [r.finish_reason for r in results] == ["length", "error", "error", "length", "error"]
    assert results[1].error == "empty prompt"
    assert "1502 tokens, longer than the 512-token context of one sequence (raise --ctx)" in results[2].error
    assert "token ids outside the vocabulary" in results[4].error
    assert results[0].completion_tokens == results[3].completion_tokens == GREEDY.max_tokens
    with pytest.raises(PromptError, match="empty prompt"):
        engine.add("")


@pytest.mark.parametrize("kv_unified, n_ctx_seq", [(False, 256), (True, 512)], ids=["per-seq-kv", "unified-kv"])
def test_a_sequence_stops_at_the_end_of_its_context(make_engine, kv_unified, n_ctx_seq):
    engine = make_engine(n_ctx=512, n_parallel=2, kv_unified=kv_unified)
    assert engine.ctx.n_ctx_seq == n_ctx_seq  # its share of the cache, or (unified) all of it
    result = engine.generate(["hello"], SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))[0]
    assert result.finish_reason == "length"
    assert result.prompt_tokens + result.completion_tokens == n_ctx_seq + 1  # the last token is sampled, never decoded


def test_full_kv_cache_preempts_and_every_sequence_still_completes(make_engine, decode_calls):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = PROMPTS[:6]
    engine = make_engine(n_ctx=256, n_parallel=6, kv_unified=True)
    tight = engine.generate(prompts, params)
    assert 1 in decode_calls  # llama_decode really ran out of KV cells
    assert engine.stats.preemptions > 0 and engine.stats.decode_calls == len(decode_calls)
    assert all(r.finish_reason == "length" and r.completion_tokens == 60 for r in tight)
    ample = make_engine(n_ctx=2048, n_parallel=6, kv_unified=True).generate(prompts, params)
    # greedy on an F32 model: recomputing a preempted sequence's KV gives the same tokens
    assert [r.token_ids for r in tight] == [r.token_ids for r in ample]


def _invalid_utf8(piece: bytes) -> bool:
    try:
        piece.decode()
    except UnicodeDecodeError:
        return True
    return False


def test_many_long_sequences_in_a_tiny_cache_all_complete_as_with_ample_memory(make_engine, decode_calls):
    """16 prompts (some sharing a prefix) x 80 tokens through 8 slots of a 256-cell unified cache,
    which holds about three of them at full length."""
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    prompts = PROMPTS + [f"Story {i}: once upon a time there was" for i in range(8)]
    tight_engine = make_engine(n_ctx=256, n_parallel=8, kv_unified=True)
    tight = tight_engine.generate(prompts, params)
    assert 1 in decode_calls and tight_engine.stats.preemptions > 0
    assert all(r.error is None and r.completion_tokens == 80 for r in tight)
    ample = make_engine(n_ctx=4096, n_parallel=8, kv_unified=True).generate(prompts, params)
    assert [r.token_ids for r in tight] == [r.token_ids for r in ample]


def failing_decode(monkeypatch, times: int | None):
    """llama_decode answering -1 (llama.cpp's "error") for the next `times` calls (None: all)."""
    import llama_cpp

    real, left = llama_cpp.llama_decode, [times]

    def decode(ctx, batch):
        if left[0] is None or left[0] > 0:
            left[0] = None if left[0] is None else left[0] - 1
            return -1
        return real(ctx, batch)

    monkeypatch.setattr(llama_cpp, "llama_decode", decode)


def test_a_failed_step_fails_the_sequences_it_carried_and_no_others(make_engine, monkeypatch):
    engine = make_engine(n_parallel=1)
    running, waiting = engine.submit(["hello world", "Once upon a time"], GREEDY)
    engine.step()  # the first prompt is decoding; the second waits for the slot
    failing_decode(monkeypatch, times=1)
    events = engine.step()
    assert [(e.uid, e.finish_reason) for e in events] == [(running.uid, "error")]
    assert running.error == "llama_decode failed with code -1 (error)" and not running.refused
    while engine.has_work:
        engine.step()
    assert (waiting.finish_reason, waiting.n_generated, waiting.error) == ("length", 12, None)
    assert engine.stats.failed_steps == 1 and engine.broken is None


def test_a_follower_given_its_prefix_in_a_failed_step_fails_with_it(make_engine, monkeypatch):
    """The step decoded the prompt and copied it to the other samples, then failed before they
    sampled: they have nothing to decode and would wait forever."""
    engine = make_engine(n_parallel=4)
    samples = engine.add("hello world", SamplingParams(temperature=0, max_tokens=4, n=3))

    def broken_sampling(*args):
        raise RuntimeError("a sampler fault")

    monkeypatch.setattr(engine.stepper, "_sample", broken_sampling)
    events = engine.step()
    assert sorted(e.uid for e in events) == sorted(s.uid for s in samples)
    assert all(s.finish_reason == "error" and "RuntimeError: a sampler fault" in s.error for s in samples)
    assert not engine.has_work


def test_three_failed_steps_in_a_row_break_the_engine(make_engine, monkeypatch):
    from llamabatch import EngineBroken

    engine = make_engine(n_parallel=1)
    failing_decode(monkeypatch, times=None)
    for prompt in ("a", "b", "c"):
        [seq] = engine.submit([prompt], GREEDY)
        assert [e.finish_reason for e in engine.step()] == ["error"]
    assert engine.broken.startswith("3 engine steps failed in a row")
    engine.submit(["d"], GREEDY)
    with pytest.raises(EngineBroken, match="3 engine steps failed in a row"):
        engine.step()


def test_two_long_prompts_are_read_together_beside_decoders_in_small_steps(make_engine):
    """With a step target shorter than a decode step, prompts beside decoding sequences are read
    MIN_TOKENS a step, shared between them (after one probe step measures a prompt token): every
    decoding sequence gets its token every step, and both long prompts progress in every step
    while both are being read."""
    from llamabatch.engine.scheduling.budget import MIN_TOKENS, PROBE_TOKENS

    engine = make_engine(n_parallel=4, n_ctx=4 * 1024, step_target=1e-6)
    streams = engine.submit(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(5):  # their prompts, then steps of decode rows alone (what a decode step costs)
        engine.step()
    long_prompts = [" ".join(f"{w}{i}" for i in range(120)) for w in ("apple", "river")]
    readers = engine.submit(long_prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(r.n_prompt > 4 * PROBE_TOKENS for r in readers)
    read = []
    while any(r.t_first_token is None for r in readers):
        both = all(r.n_past < r.n_prompt - 1 for r in readers)
        before = [(r.n_past, s.n_generated) for r, s in zip(readers, streams)]
        engine.step()
        read.append([min(r.n_past, r.n_prompt) - min(n, r.n_prompt) for r, (n, _) in zip(readers, before)])  # prompt tokens
        assert [s.n_generated for s in streams] == [g + 1 for _, g in before]  # no stream stalls
        assert not both or all(n > 0 for n in read[-1])  # neither waits for the other to be read
    assert sum(read[0]) == PROBE_TOKENS
    assert all(sum(step) <= MIN_TOKENS for step in read[1:]) and sum(read[1]) == MIN_TOKENS
    while engine.has_work:
        engine.step()
    assert [(r.n_generated, r.finish_reason) for r in readers] == [(4, "length")] * 2


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),  # plain greedy rows
    SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=9, ignore_eos=True),  # plain sampled rows
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2),  # the general path
    SamplingParams(temperature=0, max_tokens=9, stop=["zzzz"], ignore_eos=True),  # a stop string watched
], ids=["greedy", "sampled", "logprobs", "stop string"])
def test_a_sequence_no_one_streams_sends_only_its_last_event(make_engine, params):
    """Events are built for the tokens someone reads: a streamed sequence sends one per token
    (their texts add up to its text), one answered whole (streamed=False) only its last, which
    carries the same kind of Result: its text (made at its end where nothing watches it as it
    comes) is what a stream of its tokens shows."""
    from llamabatch.engine.text import TextStream

    engine = make_engine(n_parallel=4)
    streamed = engine.submit(PROMPTS[:2], params)
    whole = engine.submit(PROMPTS[2:4], params, streamed=False)
    events = [event for event in engine.run() if event.progress is None]
    for seq in streamed:
        mine = [e for e in events if e.uid == seq.uid]
        assert [e.token for e in mine] == seq.tokens[seq.n_prompt :] == list(mine[-1].result.token_ids)
        assert "".join(e.text for e in mine) == mine[-1].result.text
        assert len(mine[-1].result.logprobs) == (9 if params.logprobs else 0)
    for seq in whole:
        (only,) = [e for e in events if e.uid == seq.uid]
        assert only.finish_reason == "length" and only.result.completion_tokens == 9
        assert only.result.token_ids == seq.tokens[seq.n_prompt :]
        stream = TextStream(params.stop)
        assert only.result.text == "".join(stream.push(engine.vocab.piece(t)) for t in only.result.token_ids) + stream.finish()
        assert seq.whole_text == (not params.stop and not params.logprobs)
        assert len(only.result.logprobs) == (9 if params.logprobs else 0)
    assert engine.stats.completion_tokens == 4 * 9


def test_rows_answered_whole_end_where_their_streams_do(make_engine, tiny_eos_model):
    """A plain step whose rows are all answered whole only appends their picks while none can
    end (postprocess.QuietRows); each row still ends at its own end of generation or length, with
    the tokens the same row streamed shows. The model's greedy choice is always its end of
    generation: min_tokens holds it off, so the rows end at steps set apart, and beside others."""
    ends = [(12, 3), (12, 7), (5, 5), (20, 10)]  # (max_tokens, min_tokens)
    params = [SamplingParams(temperature=0, max_tokens=m, min_tokens=n) for m, n in ends]
    seen = {}
    for streamed in (True, False):
        engine = make_engine(tiny_eos_model, n_parallel=4)
        sequences = engine.submit(PROMPTS[:4], params, streamed=streamed)
        assert all(seq.whole_text != streamed for seq in sequences)
        for _ in engine.run():
            pass
        seen[streamed] = [(seq.finish_reason, seq.tokens[seq.n_prompt :]) for seq in sequences]
        assert engine.stats.completion_tokens == 4 + 8 + 5 + 11
    assert seen[False] == seen[True]
    assert [(reason, len(tokens)) for reason, tokens in seen[False]] == [("stop", 4), ("stop", 8), ("length", 5), ("stop", 11)]


@pytest.mark.parametrize("streamed", [(False, False), (True, False)], ids=["none streamed", "one streamed"])
def test_a_long_prompt_is_read_whole_beside_decoders_no_one_streams(make_engine, streamed):
    """The step budget keeps streams flowing: beside decoders whose end alone is awaited
    (streamed=False: generate(), a job's lines, a server's whole answers) a long prompt is read
    in whole chunks, as with no budget; one stream among them, and it is read in the budget's
    pieces again. Every decoder gets its token every step either way."""
    from llamabatch.engine.scheduling.budget import PROBE_TOKENS

    engine = make_engine(n_parallel=4, n_ctx=4 * 1024, step_target=1e-6)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    decoders = [seq for prompt, s in zip(PROMPTS, streamed) for seq in engine.submit([prompt], params, streamed=s)]
    for _ in range(5):  # their prompts, then steps of decode rows alone (what a decode step costs)
        engine.step()
    (reader,) = engine.submit([" ".join(f"apple{i}" for i in range(120))], SamplingParams(temperature=0, max_tokens=4))
    assert reader.n_prompt > 4 * PROBE_TOKENS
    read = []
    while reader.t_first_token is None:
        before = reader.n_past, [d.n_generated for d in decoders]
        engine.step()
        read.append(min(reader.n_past, reader.n_prompt) - before[0])
        assert [d.n_generated for d in decoders] == [n + 1 for n in before[1]]
    if any(streamed):
        assert read[0] == PROBE_TOKENS and len(read) > 4
    else:
        room = engine.ctx.n_batch - len(decoders)  # whole chunks: what n_batch leaves beside the decoders
        assert read == [room] * (reader.n_prompt // room) + [reader.n_prompt % room]


# A plain step passes through its four roles (schedule, decode, sample, accept) and the values
# they hand on; the modules it may run code in, by role.
PLAIN_STEP = {
    "step": {"batch_engine", "stepper"},
    "schedule": {"scheduling.scheduler", "scheduling.queue", "scheduling.budget"},
    "decode": {"native.handles", "native.backend"},
    "sample": {"sampling.picker"},
    "accept": {"postprocess"},
    "values": {"sequence", "results", "text"},
}


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
def test_a_plain_greedy_step_runs_only_its_roles_and_keeps_its_batch(make_engine, streamed, monkeypatch):
    """Traced: the llamabatch modules whose code a repeated plain greedy step runs. Memory,
    speculation, adapters, the prompt cache or a new layout of the batch (rows: the step's arrays
    are kept between steps) on that path fail here. (The snapshot, published every
    PUBLISH_EVERY_S rather than a step, is held off: on a loaded host one falls due in any step.)"""
    monkeypatch.setattr(batch_engine, "PUBLISH_EVERY_S", math.inf)
    engine = make_engine(n_parallel=4)
    engine.submit(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), streamed=streamed)
    for _ in range(3):
        engine.step()
    ran: set[str] = set()

    def trace(frame, event, _arg) -> None:
        name = frame.f_globals.get("__name__", "")
        if event == "call" and name.startswith("llamabatch.engine."):
            ran.add(name.removeprefix("llamabatch.engine."))

    sys.setprofile(trace)
    try:
        events = engine.step()
    finally:
        sys.setprofile(None)
    assert engine.stats.completion_tokens == 4 * 4  # the traced step sampled a token for each
    assert len(events) == (4 if streamed else 0)
    assert {"stepper", "scheduling.scheduler", "native.handles", "sampling.picker", "postprocess"} <= ran  # it traced the step
    assert ran <= set().union(*PLAIN_STEP.values()), f"outside a plain step's roles: {sorted(ran - set().union(*PLAIN_STEP.values()))}"
