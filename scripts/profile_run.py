#!/usr/bin/env python
"""Where `llamabatch run` spends its time: the share inside llama_decode (timed without the
profiler), then a cProfile of the same run, the functions that cost most by their own time.

    python scripts/profile_run.py prompts.txt --model tiny.gguf --max-tokens 8 --parallel 32 --ctx 8192
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import llama_cpp

from llamabatch import BatchEngine, SamplingParams
from llamabatch.jobs.prompts import read_prompts_file


def run(args: argparse.Namespace, profiler: cProfile.Profile | None = None) -> tuple[float, float, BatchEngine]:
    """One run; its wall seconds and the seconds inside llama_decode."""
    prompts, params = read_prompts_file(args.prompts, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    inside = 0.0
    real = llama_cpp.llama_decode

    def timed(ctx, batch):
        nonlocal inside
        started = time.perf_counter()
        code = real(ctx, batch)
        inside += time.perf_counter() - started
        return code

    llama_cpp.llama_decode = timed
    try:
        with BatchEngine(args.model, n_parallel=args.parallel, n_ctx=args.ctx, n_threads=args.threads) as engine:
            started = time.perf_counter()
            if profiler:
                profiler.enable()
            engine.submit(prompts, params)
            while engine.has_work:
                engine.step()
            if profiler:
                profiler.disable()
            return time.perf_counter() - started, inside, engine
    finally:
        llama_cpp.llama_decode = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", type=Path)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--parallel", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    wall, inside, engine = run(args)
    print(f"wall {wall:.2f} s, inside llama_decode {inside:.2f} s ({inside / wall:.0%}), "
          f"{engine.stats.completion_tokens / wall:,.0f} generated tokens/s, {engine.stats.decode_calls} decode calls")
    profiler = cProfile.Profile()
    run(args, profiler)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
