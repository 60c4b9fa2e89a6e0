#!/usr/bin/env python
"""Unified vs per-sequence KV cache on the `llamabatch run` workload, with and without a shared prefix.

32 prompts x 64 greedy tokens (EOS ignored) at --parallel 4, 16 and 32; each setting runs
--repeat times, the two layouts alternating, and the median tokens/s is printed.
"prefix" prepends the same 72-token instruction to every prompt (shared KV when possible).
"staggered" gives each prompt its own length (16 to 64 tokens, fixed per prompt), as EOS does
in real work: sequences finish at different steps and new prompts prefill beside decoding ones.

    python scripts/bench_kv_layout.py [--model NAME] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics

from llamabatch import BatchEngine, SamplingParams

SUBJECTS = [
    "the moon", "bread", "rivers", "chess", "volcanoes", "the violin", "honey bees", "glass", "maps", "tea",
    "bicycles", "snow", "lighthouses", "paper", "owls", "the printing press", "copper", "gardens", "trains",
    "clocks", "salt", "whales", "bridges", "wool", "comets", "the piano", "deserts", "ink", "castles", "rain",
    "cheese", "kites",
]
INSTRUCTION = (
    "You are writing entries for a children's encyclopedia. Each entry starts with a one-sentence "
    "definition, then gives two surprising facts, then ends with a question that invites the reader "
    "to look closer at the world around them. Use simple words, short sentences and a warm tone. "
    "Avoid dates and numbers unless they matter. Here is the next entry. "
)


def tokens_per_s(model: str | None, prompts: list[str], parallel: int, unified: bool, staggered: bool) -> float:
    per_seq = 512  # the longest prompt plus 64 tokens, rounded up to llama.cpp's 256
    lengths = [16 + (i * 37) % 49 for i in range(len(prompts))] if staggered else [64] * len(prompts)
    with BatchEngine(model, n_parallel=parallel, n_ctx=parallel * per_seq, kv_unified=unified) as engine:
        engine.generate(prompts[:parallel], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
        engine.drop_cached_prefixes()
        engine.reset_stats()
        engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths])
        return engine.stats.tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--parallel", default="4,16,32")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    workloads = {
        "distinct": [f"Tell me about {s}." for s in SUBJECTS],
        "prefix": [f"{INSTRUCTION}Subject: {s}." for s in SUBJECTS],
        "staggered": [f"Tell me about {s}." for s in SUBJECTS],
    }
    for name, prompts in workloads.items():
        for parallel in map(int, args.parallel.split(",")):
            runs: dict[bool, list[float]] = {False: [], True: []}
            for r in range(args.repeat):
                for unified in (bool(r % 2), not r % 2):
                    runs[unified].append(tokens_per_s(args.model, prompts, parallel, unified, staggered=name == "staggered"))
            row = {"workload": name, "parallel": parallel,
                   "per_sequence_tok_s": round(statistics.median(runs[False]), 1),
                   "unified_tok_s": round(statistics.median(runs[True]), 1)}
            row["unified_vs_per_sequence"] = round(row["unified_tok_s"] / row["per_sequence_tok_s"], 3)
            print(json.dumps(row) if args.json else "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
