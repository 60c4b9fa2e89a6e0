"""LoRA adapters against llama.cpp's own server, in one run.

  python scripts/bench_lora.py                       # all three parts
  python scripts/bench_lora.py --parts equality --prompts 16

Prints:
- equality: greedy tokens of llamabatch against `llama-server --lora` (scripts/build_native.sh
  builds it; one slot, so every request decodes alone) for four adapter sets chosen per request
  (none, a, b, a and b at half scale), on the tests' tiny model with two generated adapters and
  on the default model with one. llamabatch runs each prompt alone, then all in one batch.
- served: output tokens/s of `llamabatch serve --lora` against `llama-server --lora` with 16
  streaming clients (scripts/loadtest.py), the same slots, context and threads; alternating,
  median of paired ratios.
- mixed: one job whose requests alternate between two adapters against the same job under one
  adapter (and under none), BatchEngine in this process; alternating, median of paired ratios,
  with the sequences each llama_decode carried.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llamabatch import BatchEngine, SamplingParams
from llamabatch.catalog import Catalog

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_embeddings import free_port, native_bin, wait_healthy  # noqa: E402
from tiny_model import write_lora_for, write_tiny_lora, write_tiny_model  # noqa: E402

SUBJECTS = ["the sea", "bread", "trains", "owls", "glass", "chess", "rain", "copper", "maps", "tea", "kites", "bees"]
SETS = {"none": (), "a": ((0, 1.0),), "b": ((1, 1.0),), "a+b at 0.5": ((0, 0.5), (1, 0.5))}


def prompts(n: int) -> list[str]:
    return [f"Write a short paragraph about {SUBJECTS[i % len(SUBJECTS)]}, number {i}:" for i in range(n)]


class Server:
    """A server process on a free loopback port, up until the block ends."""

    def __init__(self, command: list[str]) -> None:
        self.port = free_port()
        self.command = [*command, "--port", str(self.port)]
        self.base = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(self.base, self.process)
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait()


def llama_server(
    model: Path, adapters: list[Path], slots: int, ctx: int, threads: int, applied: bool, extra: tuple[str, ...] = ()
) -> Server:
    """llama-server with the adapters loaded: applied to every request at scale 1, or off until
    a request's lora field sets them."""
    lora = [arg for path in adapters for arg in ("--lora", str(path))] + ([] if applied else ["--lora-init-without-apply"])
    return Server([native_bin("llama-server"), "-m", str(model), *lora, "-np", str(slots), "-c", str(ctx), "-t", str(threads),
                   "--no-webui", *extra])


def llamabatch_serve(model: Path, adapters: list[Path], slots: int, ctx: int, threads: int, applied: bool) -> Server:
    lora = [arg for path in adapters for arg in ("--lora", f"{path}:{1 if applied else 0}")]
    return Server([sys.executable, "-m", "llamabatch.cli", "serve", "-m", str(model), *lora, "--parallel", str(slots),
                   "--ctx", str(ctx), "-t", str(threads)])


# -- equality ------------------------------------------------------------------------------


def equality(model: Path, adapters: list[Path], texts: list[str], max_tokens: int, threads: int) -> None:
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
    print(f"  {model.name}, {len(texts)} prompts x {max_tokens} greedy tokens, equal to llama-server --lora:")
    for name in sets:
        alone = sum(a == t for a, t in zip(ours_alone[name], theirs[name]))
        batched = sum(a == t for a, t in zip(ours_batched[name], theirs[name]))
        first = min((next((i for i, (x, y) in enumerate(zip(a, t)) if x != y), max_tokens)
                     for a, t in zip(ours_batched[name], theirs[name])), default=max_tokens)
        print(f"    adapters {name:11} alone {alone}/{len(texts)}, batched {batched}/{len(texts)}"
              + (f" (batched: first difference at token {first})" if batched < len(texts) else ""))


# -- served throughput ---------------------------------------------------------------------


def loadtest(base: str, clients: int, requests: int, max_tokens: int) -> dict:
    import json

    done = subprocess.run([sys.executable, str(ROOT / "scripts/loadtest.py"), "--base-url", base, "--clients", str(clients),
                           "--requests", str(requests), "--max-tokens", str(max_tokens), "--json"],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def served(model: Path, adapter: Path, args) -> None:
    """The adapter applied to every request by --lora on both sides."""
    ctx = args.clients * 512
    ratios = []
    for pair in range(args.pairs):
        rates = {}
        order = ("llama-server", "llamabatch") if pair % 2 == 0 else ("llamabatch", "llama-server")
        for side in order:
            make = llama_server if side == "llama-server" else llamabatch_serve
            with make(model, [adapter], args.clients, ctx, args.threads, applied=True) as server:
                report = loadtest(server.base, args.clients, args.requests, args.max_tokens)
                if report["completed"] != report["requests"] or report["incomplete"]:
                    print(f"    {side}: {report['errors']} errors, {report['incomplete']} incomplete of {report['requests']}: "
                          f"{report.get('error_kinds')}")
                rates[side] = report["output_tokens_per_s"]
        ratios.append(rates["llamabatch"] / rates["llama-server"])
        print(f"    llama-server {rates['llama-server']:.1f} tok/s, llamabatch {rates['llamabatch']:.1f} tok/s: {ratios[-1]:.3f}x")
    print(f"  served with one adapter, {args.clients} clients x {args.requests} requests x {args.max_tokens} tokens: "
          f"llamabatch / llama-server {statistics.median(ratios):.3f}x (median of {args.pairs}, spread {min(ratios):.3f}-{max(ratios):.3f})")


# -- mixed adapters in one job -------------------------------------------------------------


def mixed(model: Path, adapters: list[Path], args) -> None:
    texts = prompts(args.job_prompts)
    jobs = {
        "no adapter": [()] * len(texts),
        "one adapter": [((0, 1.0),)] * len(texts),
        "two, half and half": [((i % 2, 1.0),) for i in range(len(texts))],
    }
    with BatchEngine(model, n_parallel=args.clients, n_ctx=args.clients * 512, n_threads=args.threads,
                     lora=[f"{path}:0" for path in adapters]) as engine:
        engine.generate(texts[:2], SamplingParams(max_tokens=2))  # warm
        rates: dict[str, list[float]] = {name: [] for name in jobs}
        per_decode: dict[str, float] = {}
        for pair in range(args.pairs):
            names = list(jobs) if pair % 2 == 0 else list(reversed(jobs))
            for name in names:
                params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, adapters=a) for a in jobs[name]]
                engine.reset_stats()
                started = time.perf_counter()
                engine.generate(texts, params)
                rates[name].append(engine.stats.completion_tokens / (time.perf_counter() - started))
                per_decode[name] = engine.stats.sequence_slots / engine.stats.decode_calls
                per_decode[name + " switches"] = engine.stats.adapter_switches
    one = rates["one adapter"]
    print(f"  one job, {len(texts)} prompts x {args.max_tokens} tokens, {args.clients} slots:")
    for name in jobs:
        ratio = statistics.median(r / o for r, o in zip(rates[name], one))
        print(f"    {name:20} {statistics.median(rates[name]):7.1f} tok/s, {per_decode[name]:.1f} sequences per decode, "
              f"{per_decode[name + ' switches']} adapter switches; / one adapter {ratio:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--parts", default="equality,served,mixed")
    parser.add_argument("--prompts", type=int, default=12, help="equality: prompts per adapter set")
    parser.add_argument("--equality-tokens", type=int, default=32)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4, help="served: per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--job-prompts", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    gguf = Catalog.load(None).resolve(args.model).gguf_path()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, threads {args.threads}; "
          f"llama.cpp {native_bin('llama-server').split('/')[-3]} (llama-cpp-python's vendored copy)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        adapters = [write_lora_for(gguf, work / f"{gguf.stem}-lora-{s}.gguf", scale=0.02, seed=s) for s in (1, 2)]
        if "equality" in parts:
            tiny = write_tiny_model(work / "tiny.gguf")
            tiny_adapters = [write_tiny_lora(work / f"tiny-lora-{s}.gguf", seed=s) for s in (1, 2)]
            print("equality:")
            equality(tiny, tiny_adapters, prompts(args.prompts), args.equality_tokens, args.threads)
            equality(gguf, adapters, prompts(args.prompts), args.equality_tokens, args.threads)
        if "served" in parts:
            print("served:")
            served(gguf, adapters[0], args)
        if "mixed" in parts:
            print("mixed:")
            mixed(gguf, adapters, args)


if __name__ == "__main__":
    main()
