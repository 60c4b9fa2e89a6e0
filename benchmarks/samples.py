"""n samples of one long prompt: what sharing the prompt's KV buys.

Measures, on one model and one run (greedy, EOS ignored, so every sequence does the same work):
  prefill    one prefill of the prompt (one sequence, one token sampled)
  decode     64 steps of a 16-way decode whose sequences each hold a prompt of that length
  shared     the prompt with n=16: prefilled once, its KV copied to 15 more sequences
  copies     16 copies of the prompt in one batch, each prefilled on its own (sharing off)
  one-by-one 16 copies run one after another (parallel 1, sharing off)
and prints shared / (prefill + decode) (the target is <= 1.1) and copies / shared, one-by-one / shared.

"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from llamabatch import BatchEngine, SamplingParams

from .harness import Spread, tiny_model

SMOKE = ["--model", "tiny", "--prompt-tokens", "64", "--n", "4", "--gen-tokens", "8", "--rounds", "1"]

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
    if any(r.error for r in results):
        raise RuntimeError(f"a sequence failed: {[r.error for r in results if r.error]}")
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


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kv-unified", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--rounds", type=int, default=3)


def measure(model: str | None, args) -> dict[str, float]:
    """One round: seconds of each way, and the prompt tokens the shared way evaluated."""
    n, gen = args.n, args.gen_tokens
    per_seq = -(-(args.prompt_tokens + gen + 1) // 256) * 256  # llama.cpp's per-sequence cells, rounded up
    settings = dict(n_ctx=n * per_seq, n_batch=512, n_threads=args.threads, kv_unified=args.kv_unified)
    greedy = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    with BatchEngine(model, n_parallel=n, share_prefixes=False, **settings) as engine:
        prompt = long_prompt(engine, args.prompt_tokens)
        warm_up = [long_prompt(engine, 32, offset=3)]
        timed(engine, warm_up, greedy)
        t = {"prefill": timed(engine, [prompt], SamplingParams(temperature=0, max_tokens=1))}
        t["decode"] = decode_time(engine, [long_prompt(engine, args.prompt_tokens, 20 * k + 7) for k in range(n)], gen)
        t["copies"] = timed(engine, [prompt] * n, greedy)
    with BatchEngine(model, n_parallel=n, **settings) as engine:
        timed(engine, warm_up, greedy)
        engine.reset_stats()
        t["shared"] = timed(engine, [prompt], SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True, n=n))
        t["evaluated"] = engine.stats.prompt_tokens_evaluated
    with BatchEngine(model, n_parallel=1, share_prefixes=False, **{**settings, "n_ctx": per_seq}) as engine:
        t["one-by-one"] = timed(engine, [prompt] * n, greedy)
    return t


def run(args, report) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model(Path(tmp))) if args.model == "tiny" else args.model
        rounds = [measure(model, args) for _ in range(args.rounds)]
    ways = ("prefill", "decode", "shared", "copies", "one-by-one")
    rows = [[way, Spread.of([r[way] for r in rounds])] for way in ways]
    ratios = {
        "shared / (prefill + decode)": Spread.of([r["shared"] / (r["prefill"] + r["decode"]) for r in rounds]),
        "copies / shared": Spread.of([r["copies"] / r["shared"] for r in rounds]),
        "one-by-one / shared": Spread.of([r["one-by-one"] / r["shared"] for r in rounds]),
    }
    for name, value in ratios.items():
        report.figure(name, value)
    report.table(f"n = {args.n} samples of a {args.prompt_tokens}-token prompt, {args.gen_tokens} tokens each (seconds)",
                 ["way", "seconds"], rows + [[name, value] for name, value in ratios.items()],
                 f"The shared prompt's tokens evaluated: {rounds[0]['evaluated']}. Medians (lowest–highest) of {args.rounds} rounds.")
