"""LoRA adapters: greedy equality with llama-server --lora, served throughput, mixed adapters in one job.

- equality: greedy tokens of llamabatch against `llama-server --lora` (scripts/build_native.sh
  builds it; one slot, so every request decodes alone) for four adapter sets chosen per request
  (none, a, b, a and b at half scale), on the tests' tiny model with two generated adapters and
  on the default model with one. llamabatch runs each prompt alone, then all in one batch.
- served: output tokens/s of `llamabatch serve --lora` against `llama-server --lora` with 16
  streaming clients (benchmarks/loadtest.py), the same slots, context and threads; alternating,
  median of paired ratios.
- mixed: one job whose requests alternate between two adapters against the same job under one
  adapter (and under none), BatchEngine in this process; alternating, median of paired ratios,
  with the sequences each llama_decode carried.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import httpx

from llamabatch import BatchEngine, SamplingParams

from .harness import Spread, alternate, model_path, paired, tiny_model, tiny_models
from .loadtest import load
from .servers import Server, llama_server as native_server, llamabatch_serve

SMOKE = ["--model", "tiny", "--prompts", "2", "--equality-tokens", "8", "--clients", "2", "--requests", "1", "--max-tokens", "8",
         "--job-prompts", "4", "--rounds", "1"]

SUBJECTS = ["the sea", "bread", "trains", "owls", "glass", "chess", "rain", "copper", "maps", "tea", "kites", "bees"]
SETS = {"none": (), "a": ((0, 1.0),), "b": ((1, 1.0),), "a+b at 0.5": ((0, 0.5), (1, 0.5))}


def prompts(n: int) -> list[str]:
    return [f"Write a short paragraph about {SUBJECTS[i % len(SUBJECTS)]}, number {i}:" for i in range(n)]


def llama_server(model: Path, adapters: list[Path], slots: int, ctx: int, threads: int, applied: bool, extra: tuple[str, ...] = ()) -> Server:
    """llama-server with the adapters loaded: applied to every request at scale 1, or off until
    a request's lora field sets them."""
    lora = [arg for path in adapters for arg in ("--lora", str(path))] + ([] if applied else ["--lora-init-without-apply"])
    return native_server(model, *lora, "-np", slots, "-c", ctx, "-t", threads, *extra)


def llamabatch_lora_serve(model: Path, adapters: list[Path], slots: int, ctx: int, threads: int, applied: bool) -> Server:
    lora = [arg for path in adapters for arg in ("--lora", f"{path}:{1 if applied else 0}")]
    return llamabatch_serve(model, *lora, "--parallel", slots, "--ctx", ctx, "-t", threads)


# -- equality ------------------------------------------------------------------------------


def equality(model: Path, adapters: list[Path], texts: list[str], max_tokens: int, threads: int) -> list[list]:
    sets = {name: pairs for name, pairs in SETS.items() if all(id < len(adapters) for id, _ in pairs)}
    lora = [f"{path}:0" for path in adapters]
    ours_alone, ours_batched = {}, {}
    # alone: one slot of 256 cells, as the llama-server below; batched: every prompt in one batch
    with BatchEngine(model, n_parallel=1, n_ctx=256, n_threads=threads, lora=lora) as engine:
        token_prompts = [engine.tokenize_prompt(t) for t in texts]
        for name, pairs in sets.items():
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, adapters=pairs)
            ours_alone[name] = [engine.generate([p], params)[0].token_ids for p in token_prompts]
    with BatchEngine(model, n_parallel=len(texts), n_ctx=256 * len(texts), n_threads=threads, lora=lora) as engine:
        for name, pairs in sets.items():
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, adapters=pairs)
            ours_batched[name] = [r.token_ids for r in engine.generate(token_prompts, params)]
    theirs = {}
    # No context checkpoints: for sliding-window models (Gemma 3) llama-server saves and restores
    # the window's state around the prompt, which moves logits by a little (enough to flip a
    # near-tie); llamabatch and a loop written on the C API (tests/reference.py) do not.
    exact = ("--ctx-checkpoints", "0", "--no-cache-prompt")
    with llama_server(model, adapters, 1, 256, threads, applied=False, extra=exact) as server, httpx.Client(timeout=600) as http:
        for name, pairs in sets.items():
            # every id listed: llama-server reads an empty list as "the --lora defaults", not "none"
            scales = dict(pairs)
            lora_field = [{"id": id, "scale": scales.get(id, 0.0)} for id in range(len(adapters))]
            theirs[name] = []
            for p in token_prompts:
                body = {"prompt": p, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True, "lora": lora_field,
                        "return_tokens": True, "cache_prompt": False}
                answer = http.post(f"{server.base}/completion", json=body)
                answer.raise_for_status()
                theirs[name].append(answer.json()["tokens"])
    rows = []
    for name in sets:
        alone = sum(a == t for a, t in zip(ours_alone[name], theirs[name]))
        batched = sum(a == t for a, t in zip(ours_batched[name], theirs[name]))
        first = min((next((i for i, (x, y) in enumerate(zip(a, t)) if x != y), max_tokens)
                     for a, t in zip(ours_batched[name], theirs[name])), default=max_tokens)
        rows.append([model.name, name, f"{alone}/{len(texts)}", f"{batched}/{len(texts)}", first if batched < len(texts) else ""])
    return rows


# -- served throughput ---------------------------------------------------------------------


def served(model: Path, adapter: Path, args, report) -> None:
    """The adapter applied to every request by --lora on both sides."""
    ctx = args.clients * 512

    def rate(make):
        def measure() -> float:
            with make(model, [adapter], args.clients, ctx, args.threads, applied=True) as server:
                answer = load(server.base, clients=args.clients, requests=args.requests, max_tokens=args.max_tokens)
            if answer["completed"] != answer["requests"] or answer["incomplete"]:  # no throughput from failed requests
                raise RuntimeError(f"{answer['errors']} errors, {answer['incomplete']} incomplete of {answer['requests']}: "
                                   f"{answer.get('error_kinds')}")
            return answer["output_tokens_per_s"]
        return measure

    runs = alternate({"llama-server": rate(llama_server), "llamabatch": rate(llamabatch_lora_serve)}, args.rounds, label="served")
    ratio = paired(runs["llamabatch"], runs["llama-server"])
    report.figure("served_vs_llama_server", ratio)
    report.table(f"Served with one adapter: {args.clients} clients x {args.requests} requests x {args.max_tokens} tokens (output tokens/s)",
                 ["llamabatch serve", "llama-server", "llamabatch / llama-server"],
                 [[Spread.of(runs["llamabatch"]), Spread.of(runs["llama-server"]), ratio]],
                 f"Medians (lowest–highest) of {args.rounds} alternating rounds.")


# -- mixed adapters in one job -------------------------------------------------------------


def mixed(model: Path, adapters: list[Path], args, report) -> None:
    texts = prompts(args.job_prompts)
    jobs = {
        "no adapter": [()] * len(texts),
        "one adapter": [((0, 1.0),)] * len(texts),
        "two, half and half": [((i % 2, 1.0),) for i in range(len(texts))],
    }
    with BatchEngine(model, n_parallel=args.clients, n_ctx=args.clients * 512, n_threads=args.threads,
                     lora=[f"{path}:0" for path in adapters]) as engine:
        engine.generate(texts[:2], SamplingParams(max_tokens=2))  # warm
        per_decode: dict[str, tuple[float, int]] = {}

        def rate(name: str):
            def measure() -> float:
                params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, adapters=a) for a in jobs[name]]
                engine.reset_stats()
                started = time.perf_counter()
                engine.generate(texts, params)
                per_decode[name] = (engine.stats.sequence_slots / engine.stats.decode_calls, engine.stats.adapter_switches)
                return engine.stats.completion_tokens / (time.perf_counter() - started)
            return measure

        runs = alternate({name: rate(name) for name in jobs}, args.rounds, label="mixed")
    rows = [[name, Spread.of(runs[name]), *per_decode[name], paired(runs[name], runs["one adapter"])] for name in jobs]
    report.figure("two_adapters_vs_one", rows[-1][-1])
    report.table(f"One job, {len(texts)} prompts x {args.max_tokens} tokens, {args.clients} slots (tokens/s)",
                 ["adapters", "tokens/s", "sequences per decode", "adapter switches", "/ one adapter"], rows,
                 f"Medians (lowest–highest) of {args.rounds} rotating rounds, one engine.")


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--parts", default="equality,served,mixed")
    parser.add_argument("--prompts", type=int, default=12, help="equality: prompts per adapter set")
    parser.add_argument("--equality-tokens", type=int, default=32)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4, help="served: per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--job-prompts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())


def run(args, report) -> None:
    write_lora_for, write_tiny_lora = tiny_models().write_lora_for, tiny_models().write_tiny_lora
    parts = set(args.parts.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tiny = tiny_model(work)
        gguf = tiny if args.model == "tiny" else model_path(args.model)
        adapters = ([write_tiny_lora(work / f"tiny-lora-{s}.gguf", seed=s) for s in (1, 2)] if args.model == "tiny" else
                    [write_lora_for(gguf, work / f"{gguf.stem}-lora-{s}.gguf", scale=0.02, seed=s) for s in (1, 2)])
        if "equality" in parts:
            rows = []
            if args.model != "tiny":
                tiny_adapters = [write_tiny_lora(work / f"tiny-lora-{s}.gguf", seed=s) for s in (1, 2)]
                rows += equality(tiny, tiny_adapters, prompts(args.prompts), args.equality_tokens, args.threads)
            rows += equality(gguf, adapters, prompts(args.prompts), args.equality_tokens, args.threads)
            report.table(f"Greedy tokens equal to llama-server --lora ({args.prompts} prompts x {args.equality_tokens} tokens)",
                         ["model", "adapters", "alone", "batched", "batched: first difference at token"], rows)
        if "served" in parts:
            served(gguf, adapters[0], args, report)
        if "mixed" in parts:
            mixed(gguf, adapters, args, report)
