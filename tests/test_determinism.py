"""Deterministic mode: a prompt's tokens do not depend on what shares its batch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import llamabatch.native as native
from llamabatch import SamplingParams
from llamabatch.determinism import verify
from llamabatch.errors import ConfigError
from llamabatch.scheduler import Scheduler
from llamabatch.sequence import Sequence

PROMPTS = ["hi", "the capital of France is", "word " * 60, "Once upon a time " * 25, "a", "def f(x): return x * 2 " * 8]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_every_prompt_alone_equals_it_in_any_batch(tiny_model, params):
    checks = verify(PROMPTS, [3, 6], params, model=tiny_model, n_threads=2, ctx_per_seq=512)
    assert len(checks) == 2 * len(PROMPTS) and all(c.identical for c in checks), [c for c in checks if not c.identical]


@pytest.mark.parametrize("n", [1, 3])
def test_samples_equal_solo_runs_seeded_seed_plus_k(make_engine, n):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True, n=n)
    batched = make_engine(n_parallel=4, deterministic=True).generate(["hello", "Once upon a time"], params)
    solo = make_engine(n_parallel=1, deterministic=True)
    for r in batched:
        alone = solo.generate([["hello", "Once upon a time"][r.index]], SamplingParams(
            temperature=1.0, seed=11 + r.sample, max_tokens=16, ignore_eos=True))[0]
        assert alone.token_ids == r.token_ids


def test_prefill_runs_alone_and_alternates_with_decode_steps():
    sched = Scheduler(n_slots=4, n_batch=64, share_prefixes=False, isolate_prefill=True)
    seqs = [Sequence(i, "p", SamplingParams(), list(range(100 * i, 100 * i + 5 + i)), 5 + i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.admit()
    kinds = []
    for _ in range(5):
        batch = sched.schedule()
        kinds.append([(s.index, s.n_chunk) for s in batch])
        for s in batch:
            done = s.n_chunk == s.n_pending
            s.n_past += s.n_chunk
            if done:
                s.tokens.append(7)
    # a whole prompt alone, then a decode step, then the next prompt alone, ...
    assert kinds == [[(0, 5)], [(0, 1)], [(1, 6)], [(0, 1), (1, 1)], [(2, 7)]]


def test_deterministic_mode_refuses_settings_that_break_it(make_engine):
    with pytest.raises(ConfigError, match="--kv-unified"):
        make_engine(deterministic=True, kv_unified=True)
    with pytest.raises(ConfigError, match="--share-prefixes"):
        make_engine(deterministic=True, share_prefixes=True)


def test_it_cannot_start_after_ggml_chose_its_matmul(monkeypatch):
    monkeypatch.delenv("GGML_CPU_TILED_MM")
    monkeypatch.setattr(native, "_decoded", True)
    with pytest.raises(ConfigError, match="before this process decodes anything"):
        native.use_row_invariant_matmul()


@pytest.mark.real_model
def test_default_model_prompts_past_512_kv_cells_in_a_fresh_process(tmp_path):
    """Gemma 3 Q4_K_M: short and long prompts (500 tokens + 64 generated passes 512 KV cells)."""
    long = "The lighthouse keeper counted the steps and listened to the sea. " * 40
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(["Hello there", "def fib(n):", long, "Once upon a time " * 30]))
    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}  # the mode must set it itself
    done = subprocess.run(
        [sys.executable, "-m", "llamabatch.cli", "verify-determinism", "--prompts", str(prompts), "--parallel", "2,4",
         "--max-tokens", "64", "--json"], capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count('"identical": true') == 8
