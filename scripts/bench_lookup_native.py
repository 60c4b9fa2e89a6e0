#!/usr/bin/env python
"""llamabatch's prompt-lookup speculation against llama.cpp's own `llama-lookup` (built by
scripts/build_native.sh from the same llama.cpp), one sequence at a time, on the grounded prompts
of bench_speculative.py: generated tokens/s of each, alternating prompt by prompt, and each one's
acceptance. llama-lookup decodes one sequence (it has no batch); B = 1 is where they compare.

    python scripts/bench_lookup_native.py [--prompts 6] [--max-tokens 192] [--draft-max 8]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from llamabatch import BatchEngine, SamplingParams
from llamabatch.catalog import Catalog
from llamabatch.measure.sweep import native_tool

sys.path.insert(0, str(Path(__file__).parent))
from bench_speculative import grounded_prompts  # noqa: E402


def native(model: Path, prompt: str, args: argparse.Namespace) -> tuple[int, float, int, int]:
    """(tokens, seconds, drafted, accepted) of one llama-lookup run."""
    tool = native_tool("llama-lookup")
    done = subprocess.run(
        [str(tool), "-m", str(model), "-p", prompt, "-n", str(args.max_tokens), "--temp", "0", "-t", "2",
         "-c", "4096", "--spec-draft-n-max", str(args.draft_max)],
        capture_output=True, text=True, check=True,
    )
    log = done.stdout + done.stderr
    tokens, seconds = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log).groups()
    drafted = int(re.search(r"n_drafted\s+=\s+(\d+)", log).group(1))
    accepted = int(re.search(r"n_accept\s+=\s+(\d+)", log).group(1))
    return int(tokens), float(seconds), drafted, accepted


def ours(engine: BatchEngine, prompt: str, args: argparse.Namespace) -> tuple[int, float, int, int]:
    engine.drop_cached_prefixes()
    engine.reset_stats()
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    s = engine.stats
    return s.completion_tokens, s.wall_s, s.draft_tokens, s.draft_accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--draft-max", type=int, default=8)
    args = parser.parse_args()
    model = Catalog.load().resolve(None).gguf_path()
    totals = {"llama-lookup": [0, 0.0, 0, 0], "llamabatch": [0, 0.0, 0, 0]}
    with BatchEngine(n_parallel=1, n_ctx=4096, speculative="ngram", draft_max=args.draft_max) as engine:
        for i, prompt in enumerate(grounded_prompts()[: args.prompts]):
            order = (("llama-lookup", native), ("llamabatch", ours)) if i % 2 == 0 else (("llamabatch", ours), ("llama-lookup", native))
            for name, run in order:
                got = run(model if run is native else engine, prompt, args)
                totals[name] = [a + b for a, b in zip(totals[name], got)]
                print(f"prompt {i} {name}: {got[0] / got[1]:.1f} tok/s, accepted {got[3]}/{got[2]}", file=sys.stderr, flush=True)
    for name, (tokens, seconds, drafted, accepted) in totals.items():
        print(f"{name:<13} {tokens / seconds:7.1f} tok/s  acceptance {accepted / max(1, drafted):.3f}  ({tokens} tokens, {seconds:.1f} s)")
    ratio = (totals["llamabatch"][0] / totals["llamabatch"][1]) / (totals["llama-lookup"][0] / totals["llama-lookup"][1])
    print(f"llamabatch / llama-lookup: {ratio:.3f}")


if __name__ == "__main__":
    main()
