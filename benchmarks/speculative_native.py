"""llamabatch's speculation against llama.cpp's own tools (built by scripts/build_native.sh from the
same llama.cpp): prompt lookup against `llama-lookup`, or with --draft-model, drafts from a draft
model against `llama-speculative`; one sequence at a time, on the grounded prompts of
speculative.py: generated tokens/s of each, alternating prompt by prompt, and each one's
acceptance. The native tools decode one sequence (no batch); B = 1 is where they compare.

"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

from llamabatch import BatchEngine, SamplingParams

from .harness import model_path, progress, native_output, tiny_model
from .servers import native
from .speculative import grounded_prompts

SMOKE = ["--model", "tiny", "--prompts", "2", "--max-tokens", "16"]


def native_run(model: Path, prompt: str, args: argparse.Namespace) -> tuple[int, float, int, int]:
    """(tokens, seconds, drafted, accepted) of one llama-lookup or llama-speculative run."""
    tool = native("llama-speculative" if args.draft_model else "llama-lookup")
    draft = ["-md", args.draft_model] if args.draft_model else []
    _, log = native_output([tool, "-m", str(model), *draft, "-p", prompt, "-n", str(args.max_tokens), "--temp", "0", "-t", "2",
                            "-c", "4096", "--spec-draft-n-max", str(args.draft_max)], r"n_accept\s+=")
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


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--draft-max", type=int, default=15)
    parser.add_argument("--draft-model", help="a GGUF path: compare with llama-speculative")


def run(args, report) -> None:
    """Prompt by prompt, alternating which side goes first; totals over all prompts."""
    tool = "llama-speculative" if args.draft_model else "llama-lookup"
    totals = {tool: [0, 0.0, 0, 0], "llamabatch": [0, 0.0, 0, 0]}
    mode = dict(draft_model=args.draft_model) if args.draft_model else dict(speculative="ngram")
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp)) if args.model == "tiny" else model_path(args.model)
        with BatchEngine(model, n_parallel=1, n_ctx=4096, draft_max=args.draft_max, **mode) as engine:
            for i, prompt in enumerate(grounded_prompts()[: args.prompts]):
                order = ((tool, native_run), ("llamabatch", ours)) if i % 2 == 0 else (("llamabatch", ours), (tool, native_run))
                for name, side in order:
                    got = side(model if side is native_run else engine, prompt, args)
                    totals[name] = [a + b for a, b in zip(totals[name], got)]
                    progress(f"prompt {i} {name}: {got[0] / got[1]:.1f} tok/s, accepted {got[3]}/{got[2]}")
    rows = [[name, tokens / seconds, accepted / max(1, drafted), tokens, seconds] for name, (tokens, seconds, drafted, accepted) in totals.items()]
    ratio = rows[1][1] / rows[0][1]
    report.figure(f"llamabatch_vs_{tool}", ratio)
    report.table(f"One sequence at a time, {args.prompts} grounded prompts, {args.max_tokens} tokens each",
                 ["side", "tokens/s", "acceptance", "tokens", "seconds"], rows, f"llamabatch / {tool}: {ratio:.3f}.")
