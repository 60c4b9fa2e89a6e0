"""Deterministic mode: a prompt's tokens do not depend on what shares its batch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llamabatch.engine.native import backend
from llamabatch import SamplingParams
from llamabatch.measure.determinism import verify
from llamabatch import ConfigError, PromptError
from llamabatch.engine.scheduling.fillers import Filler
from llamabatch.engine.scheduling.scheduler import Scheduler
from llamabatch.engine.step import Step
from llamabatch.engine.sequence import Sequence

PROMPTS = ["hi", "the capital of France is", "word " * 60, "Once upon a time " * 25, "a", "def f(x): return x * 2 " * 8]
# (the tiny model's byte vocabulary makes "word " * 60 a 302-token prompt)


@pytest.mark.fresh_process
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_every_prompt_alone_equals_it_in_any_batch(tiny_model, params):
    checks = verify(PROMPTS, [3, 6], params, model=tiny_model, n_threads=2, ctx_per_seq=512)
    assert len(checks) == 2 * len(PROMPTS) and all(c.identical for c in checks), [c for c in checks if not c.identical]
    # bit for bit: the tiny model's F32 weights go through llamafile's sgemm from 2 rows and
    # ggml's vec_dot for 1, so this fails unless every lone decode row gets a filler
    assert all(c.logprobs_identical for c in checks), [c for c in checks if not c.logprobs_identical]


@pytest.mark.fresh_process
def test_a_prompt_too_long_for_the_check_names_the_option_that_fits_it(tiny_model):
    """verify-determinism sizes every engine by --ctx-per-seq: that is what its error suggests."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with pytest.raises(PromptError, match=r"prompt 4 is 402 tokens: with --max-tokens 24 it needs 426 KV cells, more than --ctx-per-seq 256: raise --ctx-per-seq"):
        verify(PROMPTS, [2], params, model=tiny_model, n_threads=2, ctx_per_seq=256)


@pytest.mark.fresh_process
@pytest.mark.parametrize("n", [1, 3])
def test_samples_equal_solo_runs_seeded_seed_plus_k(make_engine, n):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True, n=n)
    engine = make_engine(n_parallel=6, deterministic=True)
    batched = engine.generate(["hello", "Once upon a time"], params)
    # the n samples of a prompt, admitted together, share its prefill: it is decoded once, not n times
    assert engine.stats.prompt_tokens_evaluated == sum(r.prompt_tokens for r in batched if r.sample == 0)
    solo = make_engine(n_parallel=1, deterministic=True)
    for r in batched:
        alone = solo.generate([["hello", "Once upon a time"][r.index]], SamplingParams(
            temperature=1.0, seed=11 + r.sample, max_tokens=16, ignore_eos=True))[0]
        assert alone.token_ids == r.token_ids


def test_prefill_runs_alone_and_decoders_wait_for_at_most_n_batch_prompt_tokens():
    sched = Scheduler(n_slots=4, n_batch=10, share_prefixes=False, deterministic=True)
    seqs = [Sequence(i, "p", SamplingParams(), list(range(100 * i, 100 * i + 5 + i)), 5 + i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.admit()
    kinds = []
    for _ in range(5):
        step = sched.schedule()
        kinds.append([(s.index, n) for s, n in zip(step.rows, step.chunks)])
        for s, n in zip(step.rows, step.chunks):
            done = n == s.n_pending
            s.advance(n)
            if done:
                s.tokens.append(7)
    # whole prompts alone until 10 prompt tokens went by, then a decode step, and so on
    assert kinds == [[(0, 5)], [(1, 6)], [(0, 1), (1, 1)], [(2, 7)], [(0, 1), (1, 1), (2, 1)]]


def decoding(n_slots: int, n_past: dict[int, int], **settings) -> tuple[Scheduler, Step]:
    """A deterministic scheduler with every slot taken; the sequences in n_past (seq_id -> cells
    held) decode one token each this step, the others wait for their prefill."""
    sched = Scheduler(n_slots, n_batch=64, share_prefixes=False, deterministic=True, **settings)
    for i in range(n_slots):
        sched.add(Sequence(i, "p", SamplingParams(), [1, 2, 3], 3))
    for s in sched.admit():
        s.hold(n_past.get(s.seq_id, 0))
    rows = sorted((s for s in sched.running if s.seq_id in n_past), key=lambda s: s.seq_id)
    return sched, Step(rows, [1] * len(rows))


def test_a_lone_decode_row_past_256_cells_gets_a_filler_in_a_neighbouring_stream():
    sched, rows = decoding(5, {0: 300, 2: 300, 3: 400})
    # llama.cpp groups consecutive seq_ids: 0 would be alone in its micro-batch, 2 and 3 are not
    assert sched.fillers(rows) == [Filler(1, 0)]
    sched, rows = decoding(5, {4: 256})
    assert sched.fillers(rows) == [Filler(3, 0)]  # the last id borrows the one below
    sched, rows = decoding(5, {1: 255, 3: 100})
    assert sched.fillers(rows) == []  # short: flash attention's split-KV path is not taken


def test_the_filler_goes_at_the_neighbours_next_position():
    sched, rows = decoding(3, {0: 300})
    sched.running[1].hold(40)  # seq 1 is part way through its prompt
    assert sched.fillers(rows) == [Filler(1, 40)]


def test_one_slot_borrows_a_spare_stream_and_float_weights_pad_every_lone_row():
    sched, rows = decoding(1, {0: 5}, n_streams=2, lone_row_max_cells=0)
    assert sched.fillers(rows) == [Filler(1, 0)]


def test_no_fillers_outside_deterministic_mode():
    sched = Scheduler(n_slots=2, n_batch=64)
    sched.add(Sequence(0, "p", SamplingParams(), [1, 2, 3], 3))
    (seq,) = sched.admit()
    seq.hold(300)
    assert sched.fillers(Step([seq], [1])) == []


def test_deterministic_mode_refuses_settings_that_break_it(make_engine):
    with pytest.raises(ConfigError, match="--kv-unified"):
        make_engine(deterministic=True, kv_unified=True)
    with pytest.raises(ConfigError, match="--share-prefixes"):
        make_engine(deterministic=True, share_prefixes=True)


def test_it_cannot_start_after_ggml_chose_its_matmul(monkeypatch):
    monkeypatch.delenv("GGML_CPU_TILED_MM", raising=False)
    monkeypatch.setattr(backend.process, "decoded", True)
    with pytest.raises(ConfigError, match="before this process decodes anything"):
        backend.use_row_invariant_matmul()


@pytest.mark.real_model
def test_default_model_prompts_past_512_kv_cells_in_a_fresh_process(tmp_path):
    """Gemma 3 Q4_K_M: short and long prompts (500 tokens + 64 generated passes 512 KV cells)."""
    long = "The lighthouse keeper counted the steps and listened to the sea. " * 40
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(["Hello there", "def fib(n):", long, "Once upon a time " * 30]))
    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}  # the mode must set it itself
    done = subprocess.run(
        [sys.executable, "-m", "llamabatch.cli", "verify-determinism", "--prompts", str(prompts), "--batch-sizes", "2,4",
         "--max-tokens", "64", "--json"], capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count('"identical": true') == 8
    # without fillers the long prompt's solo run takes flash attention's split-KV path: same
    # tokens here, different log-probabilities
    assert done.stdout.count('"logprobs_identical": true') == 8
    # a line per run on the way: each prompt alone, then each batch size
    assert [line.split(" · ")[0] for line in done.stderr.splitlines() if line.startswith("verifying: ")] == [
        f"verifying: {i}/6" for i in range(1, 7)]
    assert "verifying: 6/6 · --parallel 4: 4/4 identical" in done.stderr


@pytest.mark.fresh_process
def test_a_filler_never_lands_in_a_full_stream(make_engine):
    """A finished sequence that filled its stream leaves no KV behind (nothing reuses it in
    this mode), so a filler there does not run the cache full."""
    engine = make_engine(n_parallel=2, n_ctx=512, deterministic=True)  # 256 cells per sequence
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    full = engine.add("word " * 48, params)[0]  # 242 prompt tokens: it ends when its 256 cells are used
    later = engine.add("hello", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    while engine.has_work:
        engine.step()
    assert (full.finish_reason, full.error) == ("length", None)
    assert (later.finish_reason, later.error, later.n_generated) == ("length", None, 40)
