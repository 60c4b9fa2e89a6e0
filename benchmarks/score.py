"""Perplexity of one text by `llamabatch score --chunk N` and by llama.cpp's `llama-perplexity -c N`.

Alternating processes (llama-perplexity built by scripts/build_native.sh): both perplexities,
and scored tokens per second of whole-process wall time (model loading included on both sides).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from .harness import ROOT, Spread, alternate, cli, json_lines, model_path, native_output, paired, run as run_command, tiny_model
from .servers import native

FINAL = r"Final estimate: PPL = ([\d.]+)"  # llama-perplexity's result line
SMOKE = ["--model", "tiny", "--chunk", "64", "--rounds", "1"]


def arguments(parser) -> None:
    parser.add_argument("--text", type=Path, default=ROOT / "README.md")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)


def run(args, report) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        gguf = tiny_model(Path(tmp)) if args.model == "tiny" else model_path(args.model)
        ours = cli("score", "--text", args.text, "--chunk", args.chunk, "--model", gguf, "--threads", args.threads, "--json")
        theirs = [native("llama-perplexity"), "-m", str(gguf), "-f", str(args.text), "-c", str(args.chunk), "-t", str(args.threads)]

        def llamabatch() -> tuple[float, float, int]:
            wall, out = run_command(ours)
            [summary] = [row["summary"] for row in json_lines(out) if "summary" in row]
            return wall, summary["perplexity"], summary["scored_tokens"]

        def llama_perplexity() -> tuple[float, float, int]:
            wall, out = native_output(theirs, FINAL)
            ppl = float(re.search(FINAL, out)[1])
            n_chunks, n_ctx = map(int, re.search(r"over (\d+) chunks, n_ctx=(\d+)", out).groups())
            return wall, ppl, n_chunks * (n_ctx - n_ctx // 2 - 1)

        runs = alternate({"llamabatch": llamabatch, "llama-perplexity": llama_perplexity}, args.rounds, label="score")
    rate = {side: [n / wall for wall, _, n in rows] for side, rows in runs.items()}
    rows = [[side, rows[0][1], rows[0][2], Spread.of(rate[side])] for side, rows in runs.items()]
    speed = paired(rate["llamabatch"], rate["llama-perplexity"])
    report.figure("perplexity_ratio", runs["llamabatch"][0][1] / runs["llama-perplexity"][0][1])
    report.figure("speed_ratio", speed)
    report.table(f"{args.text.name} in windows of {args.chunk} tokens, {Path(gguf).name}",
                 ["side", "perplexity", "scored tokens", "scored tokens/s (process)"], rows,
                 f"llamabatch / llama-perplexity: perplexity {report.figures['perplexity_ratio']:.6f}, "
                 f"speed {speed.show()} (median of {args.rounds} alternating rounds).")
