"""A model split over this host and two RPC servers, against the same split in llama.cpp's own tools.

The two servers are llama.cpp's `ggml-rpc-server` on 127.0.0.1 (built by
scripts/build_native.sh): two processes standing in for two hosts, sharing this machine's
cores, so every figure here is "split over local processes", not over a network.

Prints:
- equality: greedy tokens, split against unsplit, for llamabatch (each prompt alone, and all
  in one batch) and for llama-server (one slot), and llamabatch split against llama-server
  split.
- speed: S_TG at each batch size (llama-batched-bench's definition) of `llamabatch sweep` and
  `llama-batched-bench` with the same split and settings, and of both unsplit; each a fresh
  process, the four alternating, 3 rounds; medians of the ratios within a round. Then each
  step's time split vs unsplit, which is the cost of the split.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from llamabatch import BatchEngine, SamplingParams
from llamabatch.catalog import Catalog
from llamabatch.engine.rpc import probe
from llamabatch.errors import ModelError
from llamabatch.measure.sweep import SweepSettings

from .harness import Spread, alternate, cli, json_lines, native_output, paired, run as run_command, tiny_model
from .lora import prompts
from .servers import free_port, llama_server, native

SMOKE = ["--model", "tiny", "--prompts", "2", "--max-tokens", "8", "--batch-sizes", "1", "--tg", "8", "--rounds", "1"]


@contextmanager
def rpc_servers(n: int, threads: int):
    """n ggml-rpc-server processes on free loopback ports; yields their endpoints."""
    ports = [free_port() for _ in range(n)]
    procs = [subprocess.Popen([native("ggml-rpc-server"), "-p", str(p), "-t", str(threads)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
    endpoints = [f"127.0.0.1:{p}" for p in ports]
    try:
        for endpoint in endpoints:
            deadline = time.monotonic() + 30
            while True:
                try:
                    probe(endpoint, timeout=1)
                    break
                except ModelError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        yield ",".join(endpoints)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


# -- equality ------------------------------------------------------------------------------


def ours(model: Path, texts: list[str], max_tokens: int, threads: int, slots: int, **split) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with BatchEngine(model, n_parallel=slots, n_ctx=256 * slots, n_threads=threads, **split) as engine:
        token_prompts = [engine.tokenize_prompt(t) for t in texts]
        if slots == 1:
            return [engine.generate([p], params)[0].token_ids for p in token_prompts]
        return [r.token_ids for r in engine.generate(token_prompts, params)]


def theirs(model: Path, texts: list[str], max_tokens: int, threads: int, split_args: list[str]) -> list[list[int]]:
    exact = ["--ctx-checkpoints", "0", "--no-cache-prompt"]  # see lora.py: SWA checkpoints move logits
    out = []
    with llama_server(model, "-np", 1, "-c", 256, "-t", threads, *exact, *split_args) as server, httpx.Client(timeout=600) as http:
        for text in texts:
            body = {"prompt": text, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True, "return_tokens": True,
                    "cache_prompt": False}
            answer = http.post(f"{server.base}/completion", json=body)
            answer.raise_for_status()
            out.append(answer.json()["tokens"])
    return out


def equality(model: Path, ngl: int, split: str, args) -> list:
    texts = prompts(args.prompts)
    same = lambda a, b: f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"  # noqa: E731
    with rpc_servers(2, args.threads) as rpc:
        placed = dict(rpc=rpc, gpu_layers=ngl, tensor_split=split)
        split_args = ["--rpc", rpc, "-ngl", str(ngl), "-ts", split]
        a1, s1 = ours(model, texts, args.max_tokens, args.threads, 1), ours(model, texts, args.max_tokens, args.threads, 1, **placed)
        ab, sb = (ours(model, texts, args.max_tokens, args.threads, len(texts), **kw) for kw in ({}, placed))
        t_plain, t_split = theirs(model, texts, args.max_tokens, args.threads, ["-ngl", "0"]), theirs(model, texts, args.max_tokens, args.threads, split_args)
    return [f"{model.name} -ngl {ngl} -ts {split}", same(s1, a1), same(sb, ab), same(t_split, t_plain), same(s1, t_split), same(a1, t_plain)]


# -- speed ---------------------------------------------------------------------------------


def ours_s_tg(model: str, b: int, args, split_args: list[str]) -> float:
    command = cli("sweep", "-m", model, "--batch-sizes", b, "--prompt-tokens", args.pp, "--gen-tokens", args.tg,
                  "-t", args.threads, "--json", *split_args)
    return json_lines(run_command(command)[1])[-1]["s_tg"]


def native_s_tg(path: Path, b: int, args, split_args: list[str], n_batch: int, n_ubatch: int) -> float:
    context = SweepSettings(batch_sizes=(b,), prompt_tokens=args.pp, gen_tokens=args.tg).context
    command = [native("llama-batched-bench"), "-m", str(path), "-c", str(context), "-b", str(n_batch), "-ub", str(n_ubatch),
               "-t", str(args.threads), "-fa", "auto", "-npp", str(args.pp), "-ntg", str(args.tg), "-npl", str(b), "-kvu", *split_args]
    out = native_output([*command, "--output-format", "jsonl"], r'"speed_tg"')[1]
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows[0]["speed_tg"]


def speed(model_name: str, ngl: int, split: str, args, report) -> None:
    spec = Catalog.load().resolve(model_name)
    path = spec.gguf_path()
    rows = []
    with rpc_servers(2, args.threads) as rpc:
        split_args = ["--rpc", rpc, "-ngl", str(ngl), "-ts", split]
        for b in args.batch_sizes:
            runs = alternate({
                "ours split": lambda: ours_s_tg(str(path), b, args, split_args),
                "native split": lambda: native_s_tg(path, b, args, split_args, spec.n_batch, spec.n_ubatch),
                "ours unsplit": lambda: ours_s_tg(str(path), b, args, ["-ngl", "0"]),
                "native unsplit": lambda: native_s_tg(path, b, args, ["-ngl", "0"], spec.n_batch, spec.n_ubatch),
            }, args.rounds, label=f"B={b}")
            med = {name: Spread.of(v) for name, v in runs.items()}
            split_ratio = paired(runs["ours split"], runs["native split"])
            plain_ratio = paired(runs["ours unsplit"], runs["native unsplit"])
            # a step makes b tokens: its time is b / S_TG
            cost_ms = 1000 * (b / med["ours split"].median - b / med["ours unsplit"].median)
            rows.append([b, med["ours split"], med["native split"], split_ratio, med["ours unsplit"], med["native unsplit"], plain_ratio, cost_ms])
            report.figure(f"split_ratio_b{b}", split_ratio)
    report.table(f"S_TG (tokens/s), {path.name} -ngl {ngl} -ts {split} over 2 local rpc-servers, PP {args.pp}, TG {args.tg}, {args.threads} threads each",
                 ["B", "ours split", "native split", "ratio", "ours unsplit", "native unsplit", "ratio", "split cost per step (ms)"], rows,
                 f"Medians (lowest–highest) of {args.rounds} rounds, the four sides alternating, each a fresh process.")


def arguments(parser) -> None:
    parser.add_argument("--parts", default="equality,speed")
    parser.add_argument("--model", default="gemma3-270m", help="catalog name; 'tiny' for the tests' model (equality only)")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--pp", type=int, default=32)
    parser.add_argument("--tg", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)


def run(args, report) -> None:
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tiny = tiny_model(Path(tmp))
        model = tiny if args.model == "tiny" else Catalog.load().resolve(args.model).gguf_path()
        if "equality" in parts:
            rows = [equality(tiny, 2, "1,1", args)]  # layer 0 here, layer 1 on one remote, the output layer on the other
            if model != tiny:
                rows.append(equality(model, 12, "1,1", args))  # Gemma: layers 0-6 here, 7-12 on one remote, 13-17 and the output on the other
            report.table(f"Greedy tokens, {args.prompts} prompts x {args.max_tokens}: split against unsplit",
                         ["model, split", "llamabatch alone", "llamabatch batched", "llama-server", "llamabatch split = llama-server split",
                          "unsplit: llamabatch = llama-server"], rows)
        if "speed" in parts:
            speed(str(model), 2 if model == tiny else 12, "1,1", args, report)
