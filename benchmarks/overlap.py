"""Overlap on against off (--overlap): S_TG of the same greedy batches, both engines in one process.

With overlap, the next plain step is decoded before this step's tokens are accepted (text, stop
strings, events), so the host's bookkeeping runs while the device computes. On a CPU
llama_decode returns only when it is done and nothing can be gained; on a GPU it returns at
once. Two engines on the same model, one with overlap on and one off, measure the same batches
(`llamabatch sweep`'s measurement: B random prompts, TG greedy tokens each) in alternating
order, round after round; a figure is the median of the ratios paired within a round.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from llamabatch import BatchEngine
from llamabatch.measure.sweep import SweepSettings, measure

from .harness import Spread, alternate, model_path, paired, tiny_model

SMOKE = ["--model", "tiny", "--batch-sizes", "1,2", "--gen-tokens", "8", "--rounds", "1"]


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)


def run(args, report) -> None:
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    settings = SweepSettings(batch_sizes=sizes, prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_model(Path(tmp)) if args.model == "tiny" else model_path(args.model)
        engines = {mode: BatchEngine(path, n_parallel=max(sizes), n_ctx=settings.context, n_threads=args.threads, overlap=mode)
                   for mode in ("on", "off")}
        try:
            rows = [point(engines, settings, b, args.rounds, report) for b in sizes]
            ahead = engines["on"].stats.decodes_ahead
        finally:
            for engine in engines.values():
                engine.close()
    report.table(f"{path.name}: S_TG (tokens/s) with overlap on and off, PP {args.prompt_tokens}, TG {args.gen_tokens}",
                 ["B", "overlap on", "overlap off", "on / off"], rows,
                 f"Medians (lowest–highest) of {args.rounds} alternating rounds in one process; the last batch of overlap on decoded "
                 f"{ahead} steps ahead.")


def point(engines: dict[str, BatchEngine], settings: SweepSettings, b: int, rounds: int, report) -> list:
    runs = alternate({mode: (lambda engine=engine: measure(engine, settings, b).s_tg) for mode, engine in engines.items()},
                     rounds, label=f"B={b}")
    ratio = paired(runs["on"], runs["off"])
    report.figure(f"on_over_off_b{b}", ratio)
    return [b, Spread.of(runs["on"]), Spread.of(runs["off"]), ratio]
