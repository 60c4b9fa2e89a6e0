"""Unified against per-sequence KV cache on the `llamabatch run` workload, with and without a shared prefix.

32 prompts x 64 greedy tokens (EOS ignored) at each --parallel; the two layouts alternate over
--rounds. "prefix" prepends the same 72-token instruction to every prompt (shared KV where it
can be); "staggered" gives each prompt its own length (16 to 64 tokens), as EOS does in real
work: sequences finish at different steps and new prompts prefill beside decoding ones.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from llamabatch import BatchEngine, SamplingParams

from .harness import Spread, alternate, paired, tiny_model

SMOKE = ["--parallel", "4", "--rounds", "1", "--model", "tiny"]
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


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--parallel", default="4,16,32")
    parser.add_argument("--rounds", type=int, default=3)


def tokens_per_s(model: str | None, prompts: list[str], parallel: int, unified: bool, staggered: bool) -> float:
    per_seq = 512  # the longest prompt plus 64 tokens, rounded up to llama.cpp's 256
    lengths = [16 + (i * 37) % 49 for i in range(len(prompts))] if staggered else [64] * len(prompts)
    with BatchEngine(model, n_parallel=parallel, n_ctx=parallel * per_seq, kv_unified=unified) as engine:
        engine.generate(prompts[:parallel], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
        engine.drop_cached_prefixes()
        engine.reset_stats()
        engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths])
        return engine.stats.tokens_per_s


def run(args, report) -> None:
    workloads = {
        "distinct": [f"Tell me about {s}." for s in SUBJECTS],
        "prefix": [f"{INSTRUCTION}Subject: {s}." for s in SUBJECTS],
        "staggered": [f"Tell me about {s}." for s in SUBJECTS],
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model(Path(tmp))) if args.model == "tiny" else args.model
        for name, prompts in workloads.items():
            for parallel in map(int, args.parallel.split(",")):
                runs = alternate({
                    layout: (lambda unified=unified: tokens_per_s(model, prompts, parallel, unified, name == "staggered"))
                    for layout, unified in (("per-sequence", False), ("unified", True))
                }, args.rounds, label=f"{name} --parallel {parallel}")
                ratio = paired(runs["unified"], runs["per-sequence"])
                rows.append([name, parallel, Spread.of(runs["per-sequence"]), Spread.of(runs["unified"]), ratio])
                report.figure(f"unified_vs_per_sequence_{name}_{parallel}", ratio)
    report.table("Generated tokens/s by KV layout", ["workload", "--parallel", "per-sequence", "unified", "unified / per-sequence"],
                 rows, f"Medians (lowest–highest) of {args.rounds} alternating rounds.")
