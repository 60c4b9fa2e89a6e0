"""KV cache types: how many sequences fit, how fast they decode, what quantizing costs in perplexity.

Per type (K and V alike; q4_0 and q8_0 V caches run with flash attention):
- fit: KV bytes per token, and the --parallel that `llamabatch plan` finds for --ctx-per-seq
  sequences in a fixed memory budget, with the KV buffer llama.cpp then allocates;
- speed: S_TG at B 1/8/32 (PP 32, TG 64, as `llamabatch sweep`), and its ratio to f16 measured
  in the same round (types alternate in order each round; median of the rounds);
- quality: perplexity of `llamabatch score --text FILE --chunk 512` and of llama.cpp's own
  `llama-perplexity -c 512` with the same cache type (scripts/build_native.sh builds it).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from llamabatch import BatchEngine
from llamabatch.engine.config import EngineConfig
from llamabatch.engine.config import parse_size
from llamabatch.engine.sizing.planning import plan_for
from llamabatch.measure import sweep as sweep_bench

from .harness import ROOT, Spread, alternate, cli, json_lines, model_path, native_output, paired, run as run_command, tiny_model
from .score import FINAL
from .servers import native

SMOKE = ["--model", "tiny", "--types", "f16,bf16",  # the tiny model's 16-wide heads take no 32-block quantized cache
         "--rounds", "1", "--ctx-per-seq", "512", "--budget", "1GiB",
         "--batch-sizes", "1,2", "--chunk", "64"]


def fit(model: str, kind: str, ctx_per_seq: int, budget: int) -> list:
    planned, shape = plan_for(model, ctx_per_seq=ctx_per_seq, memory=budget, cache_type_k=kind, cache_type_v=kind,
                              kv_unified=EngineConfig.kv_unified)  # as --parallel auto plans
    with BatchEngine(model, n_parallel=planned.n_parallel, n_ctx=planned.n_ctx, cache_type_k=kind, cache_type_v=kind) as engine:
        allocated = engine.ctx.kv_bytes
    return [kind, shape.bytes_per_token, planned.n_parallel, planned.kv_bytes / 2**20, allocated / 2**20, planned.kv_bytes / allocated]


def speeds(model: str, kinds: list[str], args, report) -> None:
    settings = sweep_bench.SweepSettings(batch_sizes=tuple(map(int, args.batch_sizes.split(","))), prompt_tokens=32, gen_tokens=64)

    def s_tg(kind: str):
        def measure() -> dict[int, float]:
            with BatchEngine(model, n_parallel=max(settings.batch_sizes), n_ctx=settings.context, n_threads=args.threads,
                             cache_type_k=kind, cache_type_v=kind) as engine:
                return {p.batch_size: p.s_tg for p in sweep_bench.sweep(engine, settings)}
        return measure

    runs = alternate({kind: s_tg(kind) for kind in kinds}, args.rounds, label="speed")
    sizes = settings.batch_sizes
    rows = []
    for kind in kinds:
        ratios = [paired([r[b] for r in runs[kind]], [r[b] for r in runs["f16"]]) for b in sizes]
        rows.append([kind, *(Spread.of([r[b] for r in runs[kind]]) for b in sizes), *ratios])
        report.figure(f"s_tg_vs_f16_{kind}", {b: ratio for b, ratio in zip(sizes, ratios)})
    report.table("S_TG (tokens/s) by KV cache type, PP 32, TG 64",
                 ["type", *(f"S_TG B={b}" for b in sizes), *(f"/ f16 B={b}" for b in sizes)], rows,
                 f"Medians (lowest–highest) of {args.rounds} rounds, types alternating.")


def perplexities(model: str, kind: str, args) -> tuple[float, float]:
    out = run_command(cli("score", "-m", model, "--text", args.text, "--chunk", args.chunk, "-ctk", kind, "-ctv", kind,
                          "-t", args.threads, "--json"))[1]
    [ours] = [row["summary"]["perplexity"] for row in json_lines(out) if "summary" in row]
    log = native_output([native("llama-perplexity"), "-m", str(model_path(model)), "-f", str(args.text), "-c", str(args.chunk),
                         "-b", str(args.chunk), "-ctk", kind, "-ctv", kind, "-t", str(args.threads)], FINAL)[1]
    return ours, float(re.search(FINAL, log)[1])


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--types", default="f16,q8_0,q4_0")
    parser.add_argument("--ctx-per-seq", type=int, default=32768)
    parser.add_argument("--budget", default="3GiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"), help="quality: the text to score")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--parts", default="fit,speed,quality")


def run(args, report) -> None:
    kinds, parts = args.types.split(","), set(args.parts.split(","))
    if "f16" not in kinds:
        kinds.insert(0, "f16")
    if not args.text.is_file():
        args.text = ROOT / "README.md"
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model(Path(tmp))) if args.model == "tiny" else str(model_path(args.model))
        if "fit" in parts:
            report.table(f"Sequences of {args.ctx_per_seq} tokens in {args.budget} (model, buffers and this process included)",
                         ["type", "KV bytes/token", "--parallel", "KV planned (MiB)", "allocated (MiB)", "planned / allocated"],
                         [fit(model, kind, args.ctx_per_seq, parse_size(args.budget)) for kind in kinds])
        if "speed" in parts:
            speeds(model, kinds, args, report)
        if "quality" in parts:
            rows = [[kind, *perplexities(model, kind, args)] for kind in kinds]
            report.table(f"Perplexity of {args.text.name} in {args.chunk}-token windows", ["type", "llamabatch score", "llama-perplexity"], rows)
