"""`llamabatch serve` against llama.cpp's `llama-server` under concurrent streaming clients.

Both with --parallel N, -c 256·N and the same threads (llama-server built by
scripts/build_native.sh from the same llama.cpp); N clients (loadtest.py) send --requests
streamed /v1/completions of --max-tokens greedy tokens each (EOS ignored), after a warm-up. The
servers alternate, each a fresh process; figures are medians over the rounds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .harness import Spread, alternate, model_path, paired, tiny_model
from .loadtest import load
from .servers import llama_server, llamabatch_serve

SMOKE = ["--model", "tiny", "--clients", "2", "--requests", "4", "--max-tokens", "8", "--rounds", "1"]


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--clients", default="16,32", help="clients = slots, each")
    parser.add_argument("--requests", type=int, default=128, help="in all, shared by the clients")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)


def run(args, report) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        gguf = tiny_model(Path(tmp)) if args.model == "tiny" else model_path(args.model)
        for n in map(int, args.clients.split(",")):
            servers = {
                "llamabatch": lambda n=n: llamabatch_serve(gguf, "--parallel", n, "--ctx", 256 * n, "-t", args.threads),
                "llama-server": lambda n=n: llama_server(gguf, "-np", n, "-c", 256 * n, "-t", args.threads, "-kvu"),
            }

            def loaded(make, n=n):
                def measure() -> dict:
                    with make() as server:
                        load(server.base, clients=n, requests=1, max_tokens=4)  # warm-up
                        return load(server.base, clients=n, requests=max(1, args.requests // n), max_tokens=args.max_tokens)
                return measure

            runs = alternate({name: loaded(make) for name, make in servers.items()}, args.rounds, label=f"{n} clients")
            for name, results in runs.items():
                rows.append([n, name, Spread.of([r["output_tokens_per_s"] for r in results]),
                             Spread.of([r["ttft_s"]["p50"] * 1000 for r in results]), Spread.of([r["ttft_s"]["p99"] * 1000 for r in results]),
                             Spread.of([r["inter_token_s"]["p50"] * 1000 for r in results]),
                             sum(r["errors"] + r["incomplete"] for r in results)])
            ratio = paired([r["output_tokens_per_s"] for r in runs["llamabatch"]], [r["output_tokens_per_s"] for r in runs["llama-server"]])
            report.figure(f"llamabatch_vs_llama_server_{n}_clients", ratio)
            rows.append([n, "llamabatch / llama-server", ratio, "", "", "", ""])
    report.table(f"{Path(gguf).name}, {args.requests} requests of {args.max_tokens} tokens, clients = slots",
                 ["clients", "server", "output tokens/s", "TTFT p50 (ms)", "TTFT p99 (ms)", "inter-token p50 (ms)", "failed or short"], rows,
                 f"Medians (lowest–highest) of {args.rounds} alternating rounds, each server a fresh process.")
