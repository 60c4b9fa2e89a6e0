"""Throughput and latency against batch size on a real model, against native llama-batched-bench
and one-at-a-time llama-cpp-python: `llamabatch sweep --baseline native --baseline sequential`.

One sweep process; within it each batch size is measured --repeat times, llama-batched-bench
(built by scripts/build_native.sh, same llama.cpp, same settings) beside each. The points are
kept, so `python -m benchmarks report` draws them (docs/results/sweep.png).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .harness import cli, json_lines, run as run_command, tiny_model

SMOKE = ["--model", "tiny", "--batch-sizes", "1,2", "--gen-tokens", "8", "--repeat", "1"]


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model (default: the catalog's)")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-sequential", action="store_true", help="skip the one-at-a-time baseline")
    parser.add_argument("--overlap", default=None, choices=["auto", "on", "off"], help="llamabatch's --overlap (default: auto)")
    parser.add_argument("--no-kv-unified", action="store_true", help="one KV cache per sequence, on both sides")


def run(args, report) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model(Path(tmp))) if args.model == "tiny" else args.model
        command = cli("sweep", "--json", "--batch-sizes", args.batch_sizes, "--threads", args.threads, "--repeat", args.repeat,
                      "--prompt-tokens", args.prompt_tokens, "--gen-tokens", args.gen_tokens, "--baseline", "native",
                      *([] if args.no_sequential else ["--baseline", "sequential"]), *(["--model", model] if model else []),
                      *(["--overlap", args.overlap] if args.overlap else []), *(["--no-kv-unified"] if args.no_kv_unified else []))
        points = json_lines(run_command(command)[1])
    report.figure("points", points)
    sequential = not args.no_sequential
    rows = [[p["batch_size"], p["s_pp"], p["s_tg"], p["native_s_tg"], p["s_tg_ratio"],
             *([p["sequential_s"]] if sequential else []), p["tpot_p50_s"] * 1000, p["ttft_p50_s"] * 1000] for p in points]
    for p in points:
        report.figure(f"s_tg_ratio_b{p['batch_size']}", p["s_tg_ratio"])
    report.table(
        f"{Path(model).name if model else 'the default model'}: PP {args.prompt_tokens}, TG {args.gen_tokens}, {args.threads} threads"
        f"{f', overlap {args.overlap}' if args.overlap else ''}{', a KV cache per sequence' if args.no_kv_unified else ''}",
        ["B", "S_PP", "S_TG", "native S_TG", "S_TG / native", *(["Llama S (one at a time)"] if sequential else []),
         "TPOT p50 (ms)", "TTFT p50 (ms)"], rows,
        f"Tokens/s; medians of {args.repeat} repeats, native measured beside each batch size in the same process.",
    )
