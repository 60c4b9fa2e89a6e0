"""`llamabatch serve` against llama.cpp's `llama-server` under concurrent streaming clients, and
against `llamabatch batch` on the same requests.

Both servers with --parallel N, -c (256 + 2·system words)·N and the same threads (llama-server built by
scripts/build_native.sh from the same llama.cpp); N clients (loadtest.py) send --requests
streamed /v1/completions of --max-tokens tokens each (EOS ignored; greedy, or sampled as OpenAI
clients ask with --temperature and --top-p, which leave top-k and min-p at each server's own
default), after a warm-up; with --system-words each prompt starts with the same system prompt,
as an application's requests do. `batch` runs the same prompts as a prompt file with the same slots,
threads, context and sampling (top-k and min-p off, as llamabatch serve takes OpenAI requests):
what serving costs over the engine alone. The sides alternate, each a fresh process; figures are
medians over the rounds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .harness import Spread, alternate, cli, json_lines, model_path, paired, run as run_command, tiny_model
from .loadtest import client_requests, load
from .servers import llama_server, llamabatch_serve

SMOKE = ["--model", "tiny", "--clients", "2", "--requests", "4", "--max-tokens", "8", "--rounds", "1"]
SIDES = ("llamabatch", "llama-server", "batch")


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--clients", default="16,32", help="clients = slots, each")
    parser.add_argument("--requests", type=int, default=128, help="in all, shared by the clients")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=None, help="sent with each request when given")
    parser.add_argument("--system-words", type=int, default=0, help="a shared system prompt of this many words before each prompt")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"of {', '.join(SIDES)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)


def run(args, report) -> None:
    rows = []
    sides = args.sides.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        gguf = tiny_model(Path(tmp)) if args.model == "tiny" else model_path(args.model)
        for n in map(int, args.clients.split(",")):
            per_client = max(1, args.requests // n)
            ctx = (256 + 2 * args.system_words) * n  # room for a system prompt's tokens (about 1.35 a word)
            makers = {
                "llamabatch": lambda n=n, ctx=ctx: served(llamabatch_serve(gguf, "--parallel", n, "--ctx", ctx, "-t", args.threads), n, per_client, args),
                "llama-server": lambda n=n, ctx=ctx: served(llama_server(gguf, "-np", n, "-c", ctx, "-t", args.threads, "-kvu"), n, per_client, args),
                "batch": lambda n=n, ctx=ctx: batched(gguf, n, ctx, per_client, args, Path(tmp)),
            }
            runs = alternate({name: makers[name] for name in sides}, args.rounds, label=f"{n} clients")
            for name, results in runs.items():  # a throughput over failed or cut requests is no figure
                if any(r["errors"] or r["incomplete"] for r in results):
                    raise RuntimeError(f"{name} failed or cut requests at {n} clients: {results}")
            for name, results in runs.items():
                streamed = name != "batch"
                rows.append([n, name, Spread.of([r["output_tokens_per_s"] for r in results]),
                             *(Spread.of([r[key][q] * 1000 for r in results]) if streamed else ""
                               for key, q in (("ttft_s", "p50"), ("ttft_s", "p95"), ("inter_token_s", "p50"), ("inter_token_s", "p95")))])
            for a, b in (("llamabatch", "llama-server"), ("llamabatch", "batch")):
                if a in runs and b in runs:
                    ratio = paired([r["output_tokens_per_s"] for r in runs[a]], [r["output_tokens_per_s"] for r in runs[b]])
                    report.figure(f"{a}_vs_{b}_{n}_clients".replace("-", "_"), ratio)
                    rows.append([n, f"{a} / {b}", ratio, "", "", "", ""])
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}" + (
        f", top-p {args.top_p:g}" if args.top_p is not None else "")
    system = f", a shared {args.system_words}-word system prompt" if args.system_words else ""
    report.table(f"{Path(gguf).name}, {args.requests} requests of {args.max_tokens} tokens, {sampling}{system}, clients = slots",
                 ["clients", "side", "output tokens/s", "TTFT p50 (ms)", "TTFT p95 (ms)", "inter-token p50 (ms)",
                  "inter-token p95 (ms)"], rows,
                 f"Medians (lowest–highest) of {args.rounds} alternating rounds, each side a fresh process. "
                 "batch: `llamabatch batch` on the same prompts, its own tokens/s (no HTTP, no clients).")


def served(server, n: int, per_client: int, args) -> dict:
    with server:
        load(server.base, clients=n, requests=1, max_tokens=4)  # warm-up
        return load(server.base, clients=n, requests=per_client, max_tokens=args.max_tokens,
                    temperature=args.temperature, top_p=args.top_p, system_words=args.system_words)


def batched(gguf: Path, n: int, ctx: int, per_client: int, args, tmp: Path) -> dict:
    """The clients' prompts as one `llamabatch batch` prompt file: its summary, in load()'s terms."""
    prompts = tmp / f"prompts-{n}.txt"
    prompts.write_text("".join(f"{prompt}\n" for i in range(n) for prompt, _ in client_requests(i, per_client, system_words=args.system_words)))
    sampling = ["--temperature", args.temperature, "--top-k", 0, "--min-p", 0, "--top-p", 1 if args.top_p is None else args.top_p]
    out = tmp / f"out-{n}.jsonl"
    for old in tmp.glob(f"{out.name}*"):  # a job rerun would skip the lines already written: start afresh
        old.unlink()
    _, output = run_command(cli("batch", prompts, "-o", out, "--model", gguf, "--parallel", n,
                                "--ctx", ctx, "-t", args.threads, "--max-tokens", args.max_tokens, "--ignore-eos",
                                *sampling, "--json"))
    summary = json_lines(output)[-1]["summary"]
    return {"output_tokens_per_s": summary["tokens_per_s"], "errors": summary["failed"], "incomplete": summary["incomplete"]}
