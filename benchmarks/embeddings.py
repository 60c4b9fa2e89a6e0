"""Embeddings against llama.cpp's own tools and llama-cpp-python: agreement and speed.

agreement  cosine of llamabatch's vectors against `llama-embedding`'s (built by
           scripts/build_native.sh) at its packing and at llamabatch's default, beside llama.cpp's
           own spread between two packings
file       embedded tokens/s of `llamabatch embed` against `llama-embedding` on the same file
           (whole commands, model load included)
server     `llamabatch serve` against `llama-server --embeddings` under --clients concurrent
           clients, one text a request
one-by-one BatchEngine.embed against llama-cpp-python's Llama.embed, one text at a time
Every side uses mean pooling, unit vectors and one 2048-token batch (-c/-b/-ub 2048: llama.cpp
pools per micro-batch, so a text must fit one). Sides alternate; ratios are medians of rounds.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from llamabatch import BatchEngine

from .harness import Spread, alternate, cli, model_path, paired, progress, run as run_command, tiny_model
from .servers import Server, llama_server, llamabatch_serve, native

SMOKE = ["--model", "tiny", "--texts", "40", "--agree-texts", "10", "--clients", "2", "--rounds", "1"]
TOKENS = 2048
WORDS = "the river castle engine garden winter signal forest market violin planet quiet bright ancient".split()


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--parts", default="agreement,file,server,one-by-one")
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--agree-texts", type=int, default=200)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)


def texts(n: int) -> list[str]:
    """Distinct sentences of 4 to 40 words, as a corpus's short passages."""
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(4, 41)))) + f" {i}." for i in range(n)]


def llama_embedding(gguf: Path, source: Path, threads: int, output_format: str = "", tokens: int = TOKENS) -> tuple[float, str]:
    """llama-embedding packs texts into decodes of its whole context (-c): `tokens`."""
    command = [native("llama-embedding"), "-m", str(gguf), "-f", str(source), "--pooling", "mean", "-c", str(tokens),
               "-b", str(tokens), "-ub", str(tokens), "-t", str(threads), "--embd-normalize", "2"]
    return run_command(command + (["--embd-output-format", output_format] if output_format else []))


def native_vectors(gguf: Path, source: Path, threads: int, tokens: int = TOKENS) -> np.ndarray:
    # Its JSON goes through llama.cpp's log thread, not flushed at exit (llama.cpp issue 22142):
    # a short run loses it now and then (6 of 10 on the tiny model), or gets a log line inside it.
    for attempt in range(10):
        out = llama_embedding(gguf, source, threads, "json", tokens)[1]
        try:
            return np.array([d["embedding"] for d in json.JSONDecoder().raw_decode(out[out.index("{"):])[0]["data"]], dtype=np.float32)
        except (ValueError, KeyError):
            progress(f"llama-embedding's JSON was lost or broken (attempt {attempt + 1}); again")
    raise RuntimeError("llama-embedding's JSON output was lost or broken ten times")


def cosines(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    c = (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return round(float(c.min()), 6), round(float(c.mean()), 6)


def agreement(gguf: Path, corpus: list[str], args, report, work: Path) -> None:
    """llama.cpp's vectors move with how texts are packed into decodes (its kernels round by the
    rows they get): compared at llama-embedding's packing, at llamabatch's default, and llama.cpp
    against itself at two packings."""
    with BatchEngine(gguf, n_parallel=1, n_ctx=256, n_threads=args.threads) as engine:
        default = engine.config.embed_pack
        corpus = [t for t in corpus if len(engine.vocab.tokenize(t)) <= default]  # llama-embedding -c 256 takes no longer text
        source = work / "agree.txt"
        source.write_text("\n".join(corpus))
        reference = native_vectors(gguf, source, args.threads)
        rows = [[f"llamabatch --embed-pack {default} (default)", f"llama-embedding -c {TOKENS}",
                 *cosines(engine.embed(corpus, pooling="mean"), reference)]]
    with BatchEngine(gguf, n_parallel=1, n_ctx=256, n_threads=args.threads, embed_pack=TOKENS) as engine:
        rows.append([f"llamabatch --embed-pack {TOKENS}", f"llama-embedding -c {TOKENS}", *cosines(engine.embed(corpus, pooling="mean"), reference)])
    rows.append([f"llama-embedding -c {default}", f"llama-embedding -c {TOKENS}", *cosines(native_vectors(gguf, source, args.threads, default), reference)])
    report.table(f"Cosine agreement over {len(corpus)} texts", ["vectors", "against", "min", "mean"], rows)


def served_seconds(server: Server, corpus: list[str], clients: int) -> float:
    """Seconds for `clients` concurrent clients to embed the corpus, one text a request."""
    with server, httpx.Client(timeout=600) as http, ThreadPoolExecutor(clients) as pool:
        base = server.base
        http.post(f"{base}/v1/embeddings", json={"input": corpus[0]}).raise_for_status()  # warm
        started = time.perf_counter()
        for answer in pool.map(lambda text: http.post(f"{base}/v1/embeddings", json={"input": text}), corpus):
            answer.raise_for_status()
        return time.perf_counter() - started


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


def speed_row(label: str, n_tokens: int, runs: dict[str, list[float]], ours: str, theirs: str) -> list:
    rate = {side: [n_tokens / s for s in seconds] for side, seconds in runs.items()}
    return [label, Spread.of(rate[ours]), Spread.of(rate[theirs]), paired(rate[ours], rate[theirs])]


def run(args, report) -> None:
    parts = args.parts.split(",")
    corpus = texts(args.texts)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        gguf = tiny_model(work) if args.model == "tiny" else model_path(args.model)
        with BatchEngine(gguf, n_parallel=1, n_ctx=256) as engine:
            n_tokens = sum(len(engine.vocab.tokenize(t)) for t in corpus)
        if "agreement" in parts:
            agreement(gguf, corpus[: args.agree_texts], args, report, work)
        source = work / "corpus.txt"
        source.write_text("\n".join(corpus))
        rows = []
        if "file" in parts:
            embed = cli("embed", source, "-o", work / "out.npy", "-m", gguf, "-t", args.threads, "--pooling", "mean", "--overwrite", "--json")
            runs = alternate({"llamabatch embed": lambda: run_command(embed)[0],
                              "llama-embedding": lambda: llama_embedding(gguf, source, args.threads)[0]}, args.rounds, label="file")
            rows.append(speed_row("a file: whole commands", n_tokens, runs, "llamabatch embed", "llama-embedding"))
        if "server" in parts:
            ours = lambda: llamabatch_serve(gguf, "--parallel", 1, "--ctx", 256, "-t", args.threads, "--pooling", "mean")  # noqa: E731
            theirs = lambda: llama_server(gguf, "--embeddings", "--pooling", "mean", "-c", TOKENS * args.clients,  # noqa: E731
                                          "-b", TOKENS, "-ub", TOKENS, "-np", args.clients, "-t", args.threads)
            runs = alternate({"llamabatch serve": lambda: served_seconds(ours(), corpus, args.clients),
                              "llama-server": lambda: served_seconds(theirs(), corpus, args.clients)}, args.rounds, label="server")
            rows.append(speed_row(f"a server, {args.clients} clients", n_tokens, runs, "llamabatch serve", "llama-server"))
        if "one-by-one" in parts:
            theirs_s, ours_s = one_by_one(gguf, corpus, args.threads)
            rows.append(["in process: BatchEngine.embed vs Llama.embed one by one", n_tokens / ours_s, n_tokens / theirs_s, theirs_s / ours_s])
        if rows:
            for row in rows:
                report.figure(f"ratio: {row[0]}", row[-1])
            report.table(f"Embedded tokens/s, {Path(gguf).name}, {args.texts} texts ({n_tokens} tokens), {args.threads} threads",
                         ["how", "llamabatch", "llama.cpp", "llamabatch / llama.cpp"], rows,
                         f"Medians (lowest–highest) of {args.rounds} alternating rounds.")
