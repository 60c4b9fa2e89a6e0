"""Embeddings against llama.cpp's own tools and llama-cpp-python, in one run.

  python scripts/bench_embeddings.py --model gemma3-270m --texts 2000
  python scripts/bench_embeddings.py --model tiny.gguf --texts 20000 --skip-server --skip-llama-cpp-python

Prints: cosine agreement with `llama-embedding` (scripts/build_native.sh builds it) at its
packing and at llamabatch's default one, beside llama.cpp's own spread between two packings, and
embedded tokens/s of `llamabatch embed` against `llama-embedding` on the same file (whole
commands, model load included, alternating, median of paired ratios), of `llamabatch serve`
against `llama-server --embeddings` under 16 concurrent clients (one text a request; alternating,
median of paired ratios), and of
BatchEngine.embed against one-by-one `Llama.embed` from llama-cpp-python. Every side uses
mean pooling, unit vectors and one 2048-token batch (-c/-b/-ub 2048: llama.cpp pools per
micro-batch, so a text must fit one).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from llamabatch import BatchEngine
from llamabatch.catalog import Catalog

TOKENS = 2048
WORDS = "the river castle engine garden winter signal forest market violin planet quiet bright ancient".split()


def texts(n: int) -> list[str]:
    """Distinct sentences of 4 to 40 words, as a corpus's short passages."""
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(4, 41)))) + f" {i}." for i in range(n)]


def native_bin(tool: str) -> str:
    folder = subprocess.run(["bash", "scripts/build_native.sh"], capture_output=True, text=True, check=True).stdout.strip()
    return os.path.join(folder, tool)


def llama_embedding(gguf: Path, source: Path, threads: int, output_format: str = "", tokens: int = TOKENS) -> tuple[float, str]:
    """llama-embedding packs texts into decodes of its whole context (-c): `tokens`."""
    cmd = [native_bin("llama-embedding"), "-m", str(gguf), "-f", str(source), "--pooling", "mean", "-c", str(tokens),
           "-b", str(tokens), "-ub", str(tokens), "-t", str(threads), "--embd-normalize", "2"]
    if output_format:
        cmd += ["--embd-output-format", output_format]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return time.perf_counter() - started, done.stdout


def llamabatch_embed(gguf: Path, source: Path, threads: int, out: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "llamabatch.cli", "embed", str(source), "-o", str(out), "-m", str(gguf),
                    "-t", str(threads), "--pooling", "mean", "--overwrite", "--json"], capture_output=True, check=True)
    return time.perf_counter() - started


def native_vectors(gguf: Path, source: Path, threads: int, tokens: int = TOKENS) -> np.ndarray:
    for attempt in range(3):  # llama.cpp's log thread now and then breaks into the JSON it prints
        _, stdout = llama_embedding(gguf, source, threads, "json", tokens)
        try:
            return np.array([d["embedding"] for d in json.loads(stdout[stdout.index("{"):])["data"]], dtype=np.float32)
        except json.JSONDecodeError:
            print(f"  llama-embedding's JSON did not parse (attempt {attempt + 1}); again")
    raise RuntimeError("llama-embedding's JSON output did not parse three times")


def cosines(a: np.ndarray, b: np.ndarray) -> str:
    c = (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return f"min {c.min():.6f}, mean {c.mean():.6f}"


def agreement(gguf: Path, corpus: list[str], threads: int, work: Path) -> None:
    """llama.cpp's vectors move with how texts are packed into decodes (its kernels round by the
    rows they get): compared at llama-embedding's packing, at llamabatch's default, and llama.cpp
    against itself at two packings."""
    with BatchEngine(gguf, n_parallel=1, n_ctx=256, n_threads=threads) as engine:
        default = engine.config.embed_pack
        # llama-embedding -c 256 takes no text longer than that
        corpus = [t for t in corpus if len(engine.vocab.tokenize(t)) <= default]
        source = work / "agree.txt"
        source.write_text("\n".join(corpus))
        native = native_vectors(gguf, source, threads)
        print(f"  {len(corpus)} texts of at most {default} tokens")
        print(f"  llamabatch default (--embed-pack {default}) vs llama-embedding -c {TOKENS}: "
              f"{cosines(engine.embed(corpus, pooling='mean'), native)}")
    with BatchEngine(gguf, n_parallel=1, n_ctx=256, n_threads=threads, embed_pack=TOKENS) as engine:
        print(f"  llamabatch --embed-pack {TOKENS} vs llama-embedding -c {TOKENS}: {cosines(engine.embed(corpus, pooling='mean'), native)}")
    print(f"  llama.cpp's own spread, llama-embedding -c {default} vs -c {TOKENS}: "
          f"{cosines(native_vectors(gguf, source, threads, default), native)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {base} did not start")


def server_rate(cmd: list[str], port: int, corpus: list[str], clients: int) -> float:
    """Seconds for `clients` concurrent clients to embed the corpus, one text a request."""
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, process)
        with httpx.Client(timeout=600) as http, ThreadPoolExecutor(clients) as pool:
            http.post(f"{base}/v1/embeddings", json={"input": corpus[0]}).raise_for_status()  # warm
            started = time.perf_counter()
            for answer in pool.map(lambda text: http.post(f"{base}/v1/embeddings", json={"input": text}), corpus):
                answer.raise_for_status()
            return time.perf_counter() - started
    finally:
        process.terminate()
        process.wait()


def llama_server(gguf: Path, corpus: list[str], threads: int, clients: int) -> float:
    port = free_port()
    cmd = [native_bin("llama-server"), "-m", str(gguf), "--embeddings", "--pooling", "mean", "-c", str(TOKENS * clients),
           "-b", str(TOKENS), "-ub", str(TOKENS), "-np", str(clients), "-t", str(threads), "--port", str(port)]
    return server_rate(cmd, port, corpus, clients)


def llamabatch_serve(gguf: Path, corpus: list[str], threads: int, clients: int) -> float:
    port = free_port()
    cmd = [sys.executable, "-m", "llamabatch.cli", "serve", "-m", str(gguf), "--parallel", "1", "--ctx", "256",
           "-t", str(threads), "--pooling", "mean", "--port", str(port)]
    return server_rate(cmd, port, corpus, clients)


def paired(title: str, pairs: int, n_tokens: int, native: Callable[[], float], ours: Callable[[], float]) -> None:
    """Seconds of each side, `pairs` times, the first side alternating so both see the same
    machine; prints each pair and the median of the paired ratios (native time / ours)."""
    ratios = []
    for pair in range(pairs):
        if pair % 2 == 0:
            theirs, mine = native(), ours()
        else:
            mine = ours()
            theirs = native()
        ratios.append(theirs / mine)
        print(f"  native {theirs:.2f} s ({n_tokens / theirs:,.0f} tok/s), llamabatch {mine:.2f} s "
              f"({n_tokens / mine:,.0f} tok/s): {theirs / mine:.3f}x")
    print(f"{title} (median of {pairs}): {statistics.median(ratios):.3f}x (spread {min(ratios):.3f}-{max(ratios):.3f})")


def one_by_one(gguf: Path, corpus: list[str], threads: int) -> tuple[float, float]:
    from llama_cpp import LLAMA_POOLING_TYPE_MEAN, Llama

    llm = Llama(str(gguf), embedding=True, pooling_type=LLAMA_POOLING_TYPE_MEAN, n_ctx=TOKENS, n_batch=TOKENS,
                n_ubatch=TOKENS, n_threads=threads, verbose=False)
    started = time.perf_counter()
    for text in corpus:
        llm.embed(text)
    theirs = time.perf_counter() - started
    llm.close()
    with BatchEngine(gguf, n_parallel=1, n_ctx=256, n_threads=threads) as engine:
        engine.embed(corpus[:1])  # the embedding context is made on first use
        started = time.perf_counter()
        engine.embed(corpus, pooling="mean")
        return theirs, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--agree-texts", type=int, default=200)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--skip-llama-cpp-python", action="store_true")
    args = parser.parse_args()
    gguf = Catalog.load(None).resolve(args.model).gguf_path()
    corpus = texts(args.texts)
    with BatchEngine(gguf, n_parallel=1, n_ctx=256) as engine:
        n_tokens = sum(len(engine.vocab.tokenize(t)) for t in corpus)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, threads {args.threads}; "
          f"model {gguf.name}; {args.texts} texts, {n_tokens} tokens")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print(f"cosine, over the first {args.agree_texts} texts:")
        agreement(gguf, corpus[: args.agree_texts], args.threads, work)
        source = work / "corpus.txt"
        source.write_text("\n".join(corpus))
        paired("llamabatch embed / llama-embedding, whole commands", args.pairs, n_tokens,
               lambda: llama_embedding(gguf, source, args.threads)[0],
               lambda: llamabatch_embed(gguf, source, args.threads, work / "out.npy"))
        if not args.skip_server:
            paired(f"llamabatch serve / llama-server, {args.clients} clients", args.pairs, n_tokens,
                   lambda: llama_server(gguf, corpus, args.threads, args.clients),
                   lambda: llamabatch_serve(gguf, corpus, args.threads, args.clients))
        if not args.skip_llama_cpp_python:
            theirs, ours = one_by_one(gguf, corpus, args.threads)
            print(f"Llama.embed one by one {n_tokens / theirs:,.0f} tok/s, BatchEngine.embed {n_tokens / ours:,.0f} tok/s: "
                  f"{theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
