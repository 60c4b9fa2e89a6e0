#!/usr/bin/env python
"""Perplexity of one text by `llamabatch score --chunk N` and by llama.cpp's `llama-perplexity -c N`
(built by scripts/build_native.sh), in alternating processes: both perplexities, and scored
tokens per second of whole-process wall time (model loading included on both sides).

    python scripts/bench_score.py --text README.md --chunk 512 --pairs 3
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llamabatch.catalog import Catalog
from llamabatch.measure.sweep import native_tool


def timed(command: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-2000:]}")
    return time.perf_counter() - started, done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path, default=Path(__file__).resolve().parent.parent / "README.md")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--model", default=None, help="catalog name or GGUF path (default: the catalog's default)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    gguf = Catalog.load().resolve(args.model).gguf_path() if not str(args.model or "").endswith(".gguf") else Path(args.model)
    ours_cmd = [sys.executable, "-m", "llamabatch.cli", "score", "--text", str(args.text), "--chunk", str(args.chunk),
                "--model", str(gguf), "--threads", str(args.threads), "--json"]
    native_cmd = [str(native_tool("llama-perplexity")), "-m", str(gguf), "-f", str(args.text), "-c", str(args.chunk),
                  "-t", str(args.threads)]
    runs: dict[str, list[tuple[float, float, int]]] = {"llamabatch": [], "llama-perplexity": []}
    for i in range(args.pairs):
        for side in (("llamabatch", "llama-perplexity") if i % 2 == 0 else ("llama-perplexity", "llamabatch")):
            if side == "llamabatch":
                wall, out = timed(ours_cmd)
                summary = json.loads(out.splitlines()[-1])["summary"]
                runs[side].append((wall, summary["perplexity"], summary["scored_tokens"]))
            else:
                wall, out = timed(native_cmd)
                ppl = float(re.search(r"Final estimate: PPL = ([\d.]+)", out)[1])
                n_chunks, n_ctx = map(int, re.search(r"over (\d+) chunks, n_ctx=(\d+)", out).groups())
                runs[side].append((wall, ppl, n_chunks * (n_ctx - n_ctx // 2 - 1)))
            print(f"pair {i + 1} {side}: {runs[side][-1][1]:.4f} perplexity, {runs[side][-1][2] / wall:.1f} scored tokens/s",
                  file=sys.stderr)
    print(f"{args.text.name}, windows of {args.chunk} tokens, {args.pairs} alternating pairs")
    for side, rows in runs.items():
        print(f"{side:>17}: perplexity {rows[0][1]:.4f}, {rows[0][2]} scored tokens, "
              f"median {statistics.median(n / w for w, _, n in rows):.1f} scored tokens/s")
    ratio = statistics.median((n1 / w1) / (n2 / w2) for (w1, _, n1), (w2, _, n2) in zip(runs["llamabatch"], runs["llama-perplexity"]))
    print(f"llamabatch / llama-perplexity: perplexity {runs['llamabatch'][0][1] / runs['llama-perplexity'][0][1]:.6f}, "
          f"speed {ratio:.3f} (median of pairs)")


if __name__ == "__main__":
    main()
