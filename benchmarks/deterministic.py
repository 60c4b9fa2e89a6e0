"""What deterministic (batch-invariant) mode costs: S_TG and S_PP of `llamabatch sweep` with and
without --deterministic.

ggml reads GGML_CPU_TILED_MM once per process, so the two modes cannot share one: each round runs
one sweep process per mode, alternating which goes first.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .harness import alternate, cli, json_lines, median, model_path, paired, run as run_command, tiny_model

SMOKE = ["--rounds", "1", "--batch-sizes", "1,2", "--gen-tokens", "8", "--model", "tiny"]
MODES = {"default": [], "deterministic": ["--deterministic"]}


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batch-sizes", default="1,8,16")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)


def run(args, report) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model(Path(tmp)) if args.model == "tiny" else model_path(args.model))

        def sweep(extra: list[str]):
            command = cli("sweep", "--json", "--model", model, "--batch-sizes", args.batch_sizes, "--threads", args.threads,
                          "--prompt-tokens", args.prompt_tokens, "--gen-tokens", args.gen_tokens, *extra)
            return lambda: {p["batch_size"]: p for p in json_lines(run_command(command)[1])}

        runs = alternate({mode: sweep(extra) for mode, extra in MODES.items()}, args.rounds, label="modes")
    rows = []
    for b in map(int, args.batch_sizes.split(",")):
        for field in ("s_tg", "s_pp"):
            default = [r[b][field] for r in runs["default"]]
            det = [r[b][field] for r in runs["deterministic"]]
            rows.append([b, field.upper(), median(default), median(det), paired(det, default)])
            report.figure(f"{field}_ratio_b{b}", rows[-1][-1])
    report.table(f"{Path(model).name}: PP {args.prompt_tokens}, TG {args.gen_tokens}, {args.threads} threads",
                 ["B", "figure", "default (tok/s)", "deterministic (tok/s)", "deterministic / default"], rows,
                 f"Medians of {args.rounds} rounds; the ratio is the median (lowest–highest) of the rounds' ratios.")
