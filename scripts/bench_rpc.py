"""A model split over this host and two RPC servers, against the same split in llama.cpp's own
tools, in one run. The two servers are llama.cpp's `ggml-rpc-server` on 127.0.0.1 (built by
scripts/build_native.sh): two processes standing in for two hosts, sharing this machine's
cores, so every figure here is "split over local processes", not over a network.

  python scripts/bench_rpc.py                                # both parts, Gemma 3 270M and the tiny model
  python scripts/bench_rpc.py --parts speed --rounds 5

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

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_embeddings import free_port, native_bin  # noqa: E402
from bench_lora import Server, prompts  # noqa: E402
from tiny_model import write_tiny_model  # noqa: E402


@contextmanager
def rpc_servers(n: int, threads: int):
    """n ggml-rpc-server processes on free loopback ports; yields their endpoints."""
    ports = [free_port() for _ in range(n)]
    procs = [subprocess.Popen([native_bin("ggml-rpc-server"), "-p", str(p), "-t", str(threads)],
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
    exact = ["--ctx-checkpoints", "0", "--no-cache-prompt"]  # see bench_lora.py: SWA checkpoints move logits
    command = [native_bin("llama-server"), "-m", str(model), "-np", "1", "-c", "256", "-t", str(threads), "--no-webui", *exact, *split_args]
    out = []
    with Server(command) as server, httpx.Client(timeout=600) as http:
        for text in texts:
            body = {"prompt": text, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True, "return_tokens": True,
                    "cache_prompt": False}
            answer = http.post(f"{server.base}/completion", json=body)
            answer.raise_for_status()
            out.append(answer.json()["tokens"])
    return out


def equality(model: Path, ngl: int, split: str, args) -> None:
    texts = prompts(args.prompts)
    same = lambda a, b: f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"  # noqa: E731
    with rpc_servers(2, args.threads) as rpc:
        placed = dict(rpc=rpc, gpu_layers=ngl, tensor_split=split)
        split_args = ["--rpc", rpc, "-ngl", str(ngl), "-ts", split]
        a1, s1 = ours(model, texts, args.max_tokens, args.threads, 1), ours(model, texts, args.max_tokens, args.threads, 1, **placed)
        ab, sb = (ours(model, texts, args.max_tokens, args.threads, len(texts), **kw) for kw in ({}, placed))
        t_plain, t_split = theirs(model, texts, args.max_tokens, args.threads, ["-ngl", "0"]), theirs(model, texts, args.max_tokens, args.threads, split_args)
    print(f"  {model.name}, -ngl {ngl} -ts {split}, {len(texts)} prompts x {args.max_tokens} greedy tokens:")
    print(f"    llamabatch split = unsplit: alone {same(s1, a1)}, batched {same(sb, ab)}")
    print(f"    llama-server split = unsplit: {same(t_split, t_plain)}")
    differ = lambda a, b: [i for i, (x, y) in enumerate(zip(a, b)) if x != y]  # noqa: E731
    print(f"    prompts where split != unsplit: llamabatch alone {differ(s1, a1)}, llama-server {differ(t_split, t_plain)}")
    print(f"    llamabatch split alone = llama-server split: {same(s1, t_split)}; unsplit alone = llama-server unsplit: {same(a1, t_plain)}")


# -- speed ---------------------------------------------------------------------------------


def ours_s_tg(model: str, b: int, args, split_args: list[str]) -> float:
    command = [sys.executable, "-m", "llamabatch.cli", "sweep", "-m", model, "--batch-sizes", str(b), "--prompt-tokens",
               str(args.pp), "--gen-tokens", str(args.tg), "-t", str(args.threads), "--json", *split_args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llamabatch sweep failed: {done.stderr[-800:]}")
    return json.loads(done.stdout.splitlines()[-1])["s_tg"]


def native_s_tg(path: Path, b: int, args, split_args: list[str], n_batch: int, n_ubatch: int) -> float:
    context = SweepSettings(batch_sizes=(b,), prompt_tokens=args.pp, gen_tokens=args.tg).context
    command = [native_bin("llama-batched-bench"), "-m", str(path), "-c", str(context), "-b", str(n_batch), "-ub", str(n_ubatch),
               "-t", str(args.threads), "-fa", "auto", "-npp", str(args.pp), "-ntg", str(args.tg), "-npl", str(b), "-kvu", *split_args]
    for _ in range(3):  # its table goes through llama.cpp's log thread, now and then lost at exit
        done = subprocess.run(command, capture_output=True, text=True)
        for line in (done.stdout + done.stderr).splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 10 and cells[0].isdigit():
                return float(cells[7])
    raise RuntimeError(f"llama-batched-bench failed: {done.stderr[-800:]}")


def speed(model_name: str, ngl: int, split: str, args) -> None:
    spec = Catalog.load().resolve(model_name)
    path = spec.gguf_path()
    with rpc_servers(2, args.threads) as rpc:
        ours_split = ["--rpc", rpc, "-ngl", str(ngl), "-ts", split]
        native_split = ["--rpc", rpc, "-ngl", str(ngl), "-ts", split]
        sides = {
            "ours split": lambda b: ours_s_tg(model_name, b, args, ours_split),
            "native split": lambda b: native_s_tg(path, b, args, native_split, spec.n_batch, spec.n_ubatch),
            "ours unsplit": lambda b: ours_s_tg(model_name, b, args, ["-ngl", "0"]),
            "native unsplit": lambda b: native_s_tg(path, b, args, ["-ngl", "0"], spec.n_batch, spec.n_ubatch),
        }
        print(f"  {model_name}, -ngl {ngl} -ts {split}, PP {args.pp} TG {args.tg}, threads {args.threads} (servers: {args.threads} each)")
        print("    B   ours split  native split  ratio (spread)       ours unsplit  native unsplit  ratio   split cost per step")
        for b in args.batch_sizes:
            runs = {name: [] for name in sides}
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(reversed(sides))  # alternate who goes first
                for name in order:
                    runs[name].append(sides[name](b))
            med = {name: statistics.median(v) for name, v in runs.items()}
            split_ratios = [o / n for o, n in zip(runs["ours split"], runs["native split"])]
            plain_ratios = [o / n for o, n in zip(runs["ours unsplit"], runs["native unsplit"])]
            # a step makes b tokens: its time is b / S_TG
            cost_ms = 1000 * (b / med["ours split"] - b / med["ours unsplit"])
            print(f"    {b:<3} {med['ours split']:10.1f}  {med['native split']:12.1f}  {statistics.median(split_ratios):.3f}"
                  f" ({min(split_ratios):.3f}-{max(split_ratios):.3f})  {med['ours unsplit']:12.1f}  {med['native unsplit']:14.1f}"
                  f"  {statistics.median(plain_ratios):.3f}   +{cost_ms:.2f} ms ({b / med['ours unsplit'] * 1000:.2f} -> {b / med['ours split'] * 1000:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="equality,speed")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--pp", type=int, default=32)
    parser.add_argument("--tg", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    from importlib.metadata import version

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}; "
          f"llama-cpp-python {version('llama-cpp-python')}; llamabatch {commit}")
    parts = args.parts.split(",")
    gemma = Catalog.load().resolve("gemma3-270m").gguf_path()
    if "equality" in parts:
        print("equality")
        with tempfile.TemporaryDirectory() as tmp:
            tiny = write_tiny_model(Path(tmp) / "tiny.gguf")
            equality(tiny, 2, "1,1", args)  # layer 0 here, layer 1 on one remote, the output layer on the other
        equality(gemma, 12, "1,1", args)  # layers 0-6 here, 7-12 on one remote, 13-17 and the output on the other
    if "speed" in parts:
        print("speed")
        speed("gemma3-270m", 12, "1,1", args)


if __name__ == "__main__":
    main()
