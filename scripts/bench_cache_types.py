"""KV cache types on the default model: how many sequences fit, how fast they decode, and what
quantizing the cache costs in perplexity, in one run.

  python scripts/bench_cache_types.py
  python scripts/bench_cache_types.py --types f16,q8_0 --rounds 1 --budget 2GiB

Prints, per type (K and V alike; q4_0 and q8_0 V caches run with flash attention):
- fit: KV bytes per token, and the --parallel that `llamabatch plan` finds for --ctx-per-seq
  sequences in a fixed memory budget, with the KV buffer llama.cpp then allocates;
- speed: S_TG at B 1/8/32 (PP 32, TG 64, as `llamabatch sweep`), and its ratio to f16 measured
  in the same round (types alternate in order each round; median of the rounds);
- quality: perplexity of `llamabatch score --text FILE --chunk 512` and of llama.cpp's own
  `llama-perplexity -c 512` with the same cache type (scripts/build_native.sh builds it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

from llamabatch import BatchEngine
from llamabatch.catalog import Catalog
from llamabatch.engine.config import EngineConfig
from llamabatch.engine.memory import parse_size, plan_for
from llamabatch.measure import sweep as sweep_bench

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_embeddings import native_bin  # noqa: E402

TEXT = Path("/usr/share/common-licenses/GPL-3")


def fit(model: str, kind: str, ctx_per_seq: int, budget: int) -> None:
    planned, shape = plan_for(model, ctx_per_seq=ctx_per_seq, memory=budget, cache_type_k=kind, cache_type_v=kind,
                              kv_unified=EngineConfig.kv_unified)  # as --parallel auto plans
    with BatchEngine(model, n_parallel=planned.n_parallel, n_ctx=planned.n_ctx, cache_type_k=kind, cache_type_v=kind) as engine:
        allocated = engine.ctx.kv_bytes
    print(f"    {kind:5} {shape.bytes_per_token:6,} B/token  --parallel {planned.n_parallel:4}  "
          f"KV planned {planned.kv_bytes / 2**20:8.1f} MiB, allocated {allocated / 2**20:8.1f} MiB ({planned.kv_bytes / allocated:.3f})")


def speeds(model: str, kinds: list[str], rounds: int, threads: int) -> None:
    settings = sweep_bench.SweepSettings(batch_sizes=(1, 8, 32), prompt_tokens=32, gen_tokens=64)
    s_tg: dict[str, list[dict[int, float]]] = {kind: [] for kind in kinds}
    for r in range(rounds):
        for kind in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:
            with BatchEngine(model, n_parallel=32, n_ctx=settings.context, n_threads=threads,
                             cache_type_k=kind, cache_type_v=kind) as engine:
                s_tg[kind].append({p.batch_size: p.s_tg for p in sweep_bench.sweep(engine, settings)})
    sizes = settings.batch_sizes
    print("    type  " + "".join(f"   S_TG B={b:<3}" for b in sizes) + "".join(f"  / f16 B={b:<3}" for b in sizes))
    for kind in kinds:
        ratios = [statistics.median(run[b] / base[b] for run, base in zip(s_tg[kind], s_tg["f16"])) for b in sizes]
        print(f"    {kind:5} " + "".join(f"{statistics.median(run[b] for run in s_tg[kind]):12.1f}" for b in sizes)
              + "".join(f"{ratio:13.3f}" for ratio in ratios))


def perplexities(model: str, kind: str, threads: int) -> tuple[float, float]:
    ours = subprocess.run([sys.executable, "-m", "llamabatch.cli", "score", "-m", model, "--text", str(TEXT), "--chunk", "512",
                           "-ctk", kind, "-ctv", kind, "-t", str(threads), "--json"], capture_output=True, text=True, check=True)
    summary = next(json.loads(line)["summary"] for line in ours.stdout.splitlines() if line.startswith('{"summary"'))
    gguf = Catalog.load(None).resolve(model).gguf_path()
    native = subprocess.run([native_bin("llama-perplexity"), "-m", str(gguf), "-f", str(TEXT), "-c", "512", "-b", "512",
                             "-ctk", kind, "-ctv", kind, "-t", str(threads)], capture_output=True, text=True, check=True)
    theirs = float(re.search(r"Final estimate: PPL = ([\d.]+)", native.stdout + native.stderr)[1])
    return summary["perplexity"], theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--types", default="f16,q8_0,q4_0")
    parser.add_argument("--ctx-per-seq", type=int, default=32768)
    parser.add_argument("--budget", default="3GiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--parts", default="fit,speed,quality")
    args = parser.parse_args()
    kinds, parts = args.types.split(","), set(args.parts.split(","))
    if "f16" not in kinds:
        kinds.insert(0, "f16")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, threads {args.threads}; "
          f"model {args.model}; llama.cpp of llama-cpp-python {native_bin('llama-server').split('/')[-3]}")
    if "fit" in parts:
        print(f"fit: sequences of {args.ctx_per_seq} tokens in {args.budget} (model, buffers and this process included):")
        for kind in kinds:
            fit(args.model, kind, args.ctx_per_seq, parse_size(args.budget))
    if "speed" in parts:
        print(f"speed: PP 32, TG 64, {args.rounds} rounds, types alternating:")
        speeds(args.model, kinds, args.rounds, args.threads)
    if "quality" in parts:
        print(f"quality: perplexity of {TEXT} at 512-token windows:")
        for kind in kinds:
            ours, theirs = perplexities(args.model, kind, args.threads)
            print(f"    {kind:5} llamabatch score {ours:.4f}   llama-perplexity {theirs:.4f}")


if __name__ == "__main__":
    main()
