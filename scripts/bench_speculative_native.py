#!/usr/bin/env python
"""llamabatch's speculation against llama.cpp's own tools (built by scripts/build_native.sh from the
same llama.cpp): prompt lookup against `llama-lookup`, or with --draft-model, drafts from a draft
model against `llama-speculative`; one sequence at a time, on the grounded prompts of
bench_speculative.py: generated tokens/s of each, alternating prompt by prompt, and each one's
acceptance. The native tools decode one sequence (no batch); B = 1 is where they compare.

    python scripts/bench_speculative_native.py [--prompts 6] [--max-tokens 192] [--draft-max 15] [--draft-model PATH]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from llamabatch import BatchEngine, SamplingParams
from llamabatch.catalog import Catalog
from llamabatch.measure.sweep import native_tool

sys.path.insert(0, str(Path(__file__).parent))
from bench_speculative import grounded_prompts  # noqa: E402


def native(model: Path, prompt: str, args: argparse.Namespace) -> tuple[int, float, int, int]:
    """(tokens, seconds, drafted, accepted) of one llama-lookup or llama-speculative run."""
    tool = native_tool("llama-speculative" if args.draft_model else "llama-lookup")
    draft = ["-md", args.draft_model] if args.draft_model else []
    done = subprocess.run(
        [str(tool), "-m", str(model), *draft, "-p", prompt, "-n", str(args.max_tokens), "--temp", "0", "-t", "2",
         "-c", "4096", "--spec-draft-n-max", str(args.draft_max)],
        capture_output=True, text=True, check=True,
    )
    log = done.stdout + done.stderr
    tokens, seconds = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log).groups()
    drafted = int(re.search(r"n_drafted\s+=\s+(\d+)", log).group(1))
    accepted = int(re.search(r"n_accept\s+=\s+(\d+)", log).group(1))
    return int(tokens), float(seconds), drafted, accepted


def ours(engine: BatchEngine, prompt: str, args: argparse.Namespace) -> tuple[int, float, int, int]:
    """As the native tools count: generation only, from the first token on (the prompt's decode
    excluded), and, conservatively, without that first token."""
    engine.drop_cached_prefixes()
    engine.reset_stats()
    result = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))[0]
    s = engine.stats
    return result.completion_tokens - 1, result.timings.decode_s, s.draft_tokens, s.draft_accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--draft-max", type=int, default=15)
    parser.add_argument("--draft-model", help="a GGUF path: compare with llama-speculative")
    args = parser.parse_args()
    model = Catalog.load().resolve(None).gguf_path()
    tool = "llama-speculative" if args.draft_model else "llama-lookup"
    totals = {tool: [0, 0.0, 0, 0], "llamabatch": [0, 0.0, 0, 0]}
    mode = dict(draft_model=args.draft_model) if args.draft_model else dict(speculative="ngram")
    with BatchEngine(n_parallel=1, n_ctx=4096, draft_max=args.draft_max, **mode) as engine:
        for i, prompt in enumerate(grounded_prompts()[: args.prompts]):
            order = ((tool, native), ("llamabatch", ours)) if i % 2 == 0 else (("llamabatch", ours), (tool, native))
            for name, run in order:
                got = run(model if run is native else engine, prompt, args)
                totals[name] = [a + b for a, b in zip(totals[name], got)]
                print(f"prompt {i} {name}: {got[0] / got[1]:.1f} tok/s, accepted {got[3]}/{got[2]}", file=sys.stderr, flush=True)
    for name, (tokens, seconds, drafted, accepted) in totals.items():
        print(f"{name:<13} {tokens / seconds:7.1f} tok/s  acceptance {accepted / max(1, drafted):.3f}  ({tokens} tokens, {seconds:.1f} s)")
    ratio = (totals["llamabatch"][0] / totals["llamabatch"][1]) / (totals[tool][0] / totals[tool][1])
    print(f"llamabatch / {tool}: {ratio:.3f}")


if __name__ == "__main__":
    main()
