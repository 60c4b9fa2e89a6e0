#!/usr/bin/env python
"""n samples of one long prompt: what sharing the prompt's KV buys.

Measures, on one model and one run (greedy, EOS ignored, so every sequence does the same work):
  prefill    one prefill of the prompt (one sequence, one token sampled)
  decode     64 steps of a 16-way decode whose sequences each hold a prompt of that length
  shared     the prompt with n=16: prefilled once, its KV copied to 15 more sequences
  copies     16 copies of the prompt in one batch, each prefilled on its own (sharing off)
  one-by-one 16 copies run one after another (parallel 1, sharing off)
and prints shared / (prefill + decode) (the target is <= 1.1) and copies / shared, one-by-one / shared.

    python scripts/bench_samples.py [--model gemma3-270m] [--prompt-tokens 500] [--n 16] [--gen-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time

from llamabatch import BatchEngine, SamplingParams

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type made books cheap "
    "enough for merchants, students and craftsmen to own. Within fifty years presses worked in more than two "
    "hundred cities, and the number of books in Europe grew from thousands to millions. "
)


def long_prompt(engine: BatchEngine, n_tokens: int, offset: int = 0) -> list[int]:
    """n_tokens of English text (BOS first); `offset` shifts the window so prompts differ after BOS."""
    tokens = engine.tokenize_prompt(TEXT * (n_tokens // 20 + offset // 20 + 2))
    return tokens[:1] + tokens[1 + offset : n_tokens + offset]


def timed(engine: BatchEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    started = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    assert all(r.error is None for r in results), [r.error for r in results]
    return elapsed


def decode_time(engine: BatchEngine, prompts: list[list[int]], steps: int) -> float:
    """Seconds for `steps` decode steps once every prompt has its first token."""
    sequences = engine.submit(prompts, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    while any(seq.t_first_token is None for seq in sequences):
        engine.step()
    started = time.perf_counter()
    while engine.has_work:
        engine.step()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kv-unified", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    n, gen = args.n, args.gen_tokens
    per_seq = -(-(args.prompt_tokens + gen + 1) // 256) * 256  # llama.cpp's per-sequence cells, rounded up
    settings = dict(n_ctx=n * per_seq, n_batch=512, n_threads=args.threads, kv_unified=args.kv_unified)
    greedy = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    with BatchEngine(args.model, n_parallel=n, share_prefixes=False, **settings) as engine:
        prompt = long_prompt(engine, args.prompt_tokens)
        warm_up = [long_prompt(engine, 32, offset=3)]
        timed(engine, warm_up, greedy)
        t = {"prefill": timed(engine, [prompt], SamplingParams(temperature=0, max_tokens=1))}
        t["decode"] = decode_time(engine, [long_prompt(engine, args.prompt_tokens, 20 * k + 7) for k in range(n)], gen)
        t["copies"] = timed(engine, [prompt] * n, greedy)
    with BatchEngine(args.model, n_parallel=n, **settings) as engine:
        timed(engine, warm_up, greedy)
        engine.reset_stats()
        t["shared"] = timed(engine, [prompt], SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True, n=n))
        evaluated = engine.stats.prompt_tokens_evaluated
    with BatchEngine(args.model, n_parallel=1, share_prefixes=False, **{**settings, "n_ctx": per_seq}) as engine:
        t["one-by-one"] = timed(engine, [prompt] * n, greedy)

    report = {
        "prompt_tokens": len(prompt), "n": n, "kv_unified": args.kv_unified, "gen_tokens": gen, "shared_prompt_tokens_evaluated": evaluated,
        **{f"{k}_s": round(v, 3) for k, v in t.items()},
        "shared_vs_prefill_plus_decode": round(t["shared"] / (t["prefill"] + t["decode"]), 3),
        "copies_vs_shared": round(t["copies"] / t["shared"], 2),
        "one_by_one_vs_shared": round(t["one-by-one"] / t["shared"], 2),
    }
    if args.json:
        print(json.dumps(report))
        return
    for key, value in report.items():
        print(f"{key:34} {value}")


if __name__ == "__main__":
    main()
