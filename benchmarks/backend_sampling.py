"""Greedy decoding of B sequences: numpy argmax on the host (the engine's way) against llama.cpp's backend sampling, and a loop that reads no output.

Backend sampling attaches a greedy chain per seq_id to the context: the argmax runs in the
decode's graph and only token ids come back. Sides alternate; the two that sample must give the
same tokens. On a CPU the numpy argmax of a 262,144-wide row is cheaper than the graph's; on a
GPU backend sampling saves copying every row's logits to the host: run it there with -ngl -1.
The third side decodes the same token again every step and never reads an output, as
llama-batched-bench measures S_TG: where llama_decode returns before the device is done (a GPU),
it issues each step while the last one computes, which no loop that generates can do (its next
tokens are the last step's output). What it gains over the others is that wait.
"""

from __future__ import annotations

import ctypes
import tempfile
import time
from pathlib import Path

import llama_cpp
import numpy as np

from .harness import Spread, alternate, model_path, paired, tiny_model

SMOKE = ["--model", "tiny", "--batch", "4", "--steps", "8", "--rounds", "1"]
PROMPT = 16  # tokens of each sequence's prompt


def arguments(parser) -> None:
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("-ngl", "--gpu-layers", type=int, default=0)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)


SIDES = ("numpy argmax", "backend greedy", "no output read")


def context(model, b: int, steps: int, threads: int, backend: bool):
    """A context for b sequences of PROMPT + steps tokens; with backend, a greedy chain attached to every seq_id."""
    p = llama_cpp.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = b * (PROMPT + steps + 1), max(512, PROMPT * b), 512, b
    p.n_threads = p.n_threads_batch = threads
    chains = []
    if backend:
        configs = (llama_cpp.llama_sampler_seq_config * b)()
        for s in range(b):
            chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
            configs[s].seq_id, configs[s].sampler = s, ctypes.cast(chain, ctypes.c_void_p)
            chains.append(chain)
        p.samplers, p.n_samplers = configs, b
    return llama_cpp.llama_init_from_model(model, p), chains, configs if backend else None


def greedy(ctx, b: int, steps: int, n_vocab: int, side: str) -> tuple[float, list[list[int]]]:
    """Prefill b random PROMPT-token prompts, then `steps` greedy steps; tokens/s of the steps, and the tokens."""
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    batch = llama_cpp.llama_batch_init(max(512, PROMPT * b), 0, 1)  # every prompt in one decode
    try:
        rng = np.random.default_rng(0)
        n = 0
        for s in range(b):
            for i, tok in enumerate(rng.integers(10, min(1000, n_vocab), PROMPT)):
                batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = int(tok), i, 1, i == PROMPT - 1
                batch.seq_id[n][0] = s
                n += 1
        batch.n_tokens = n
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("prefill failed")
        out_rows = [PROMPT * s + PROMPT - 1 for s in range(b)]
        tokens: list[list[int]] = [[] for _ in range(b)]
        t = time.perf_counter()
        for step in range(steps):
            if side == "backend greedy":
                new = [llama_cpp.llama_get_sampled_token_ith(ctx, r) for r in out_rows]
            elif side == "no output read":
                new = [batch.token[r] for r in out_rows]  # the token it had: the step waits for nothing
            else:
                addr = ctypes.addressof(llama_cpp.llama_get_logits(ctx).contents)
                logits = np.frombuffer((ctypes.c_float * (b * n_vocab)).from_address(addr), np.float32).reshape(b, n_vocab)
                new = logits.argmax(axis=1).tolist()
            for s in range(b):
                tokens[s].append(new[s])
                batch.token[s], batch.pos[s], batch.n_seq_id[s], batch.logits[s] = new[s], PROMPT + step, 1, 1
                batch.seq_id[s][0] = s
            batch.n_tokens = b
            out_rows = list(range(b))
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError(f"decode failed at step {step}")
        llama_cpp.llama_synchronize(ctx)  # the last step done, for every side
        return b * steps / (time.perf_counter() - t), tokens
    finally:
        llama_cpp.llama_batch_free(batch)


def run(args, report) -> None:
    llama_cpp.llama_backend_init()
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_model(Path(tmp)) if args.model == "tiny" else model_path(args.model)
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = args.gpu_layers
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        try:
            runs, same = measure(model, args)
        finally:
            llama_cpp.llama_model_free(model)
    ratio = paired(runs["backend greedy"], runs["numpy argmax"])
    unread = paired(runs["no output read"], runs["numpy argmax"])
    report.figure("backend_vs_numpy", ratio)
    report.figure("no_read_vs_numpy", unread)
    report.table(f"Greedy decoding of B = {args.batch} sequences, {path.name}, -ngl {args.gpu_layers} (tokens/s)",
                 ["numpy argmax (all logits to the host)", "backend greedy (llama.cpp samples in the graph)", "backend / numpy",
                  "same tokens", "no output read (llama-batched-bench's loop)", "no read / numpy"],
                 [[Spread.of(runs["numpy argmax"]), Spread.of(runs["backend greedy"]), ratio, "yes" if same else "no",
                   Spread.of(runs["no output read"]), unread]],
                 f"Medians (lowest–highest) of {args.rounds} alternating rounds.")


def measure(model, args) -> tuple[dict[str, list[float]], bool]:
    """Each way's tokens/s over the rounds, and whether they chose the same tokens."""
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    contexts = {side: context(model, args.batch, args.steps, args.threads, side == "backend greedy") for side in SIDES}
    outputs = {}

    def side(mode: str):
        def one() -> float:
            speed, outputs[mode] = greedy(contexts[mode][0], args.batch, args.steps, n_vocab, mode)
            return speed
        return one

    try:
        for mode in SIDES:  # each context's first decodes allocate its buffers: not measured
            greedy(contexts[mode][0], args.batch, 2, n_vocab, mode)
        runs = alternate({mode: side(mode) for mode in contexts}, args.rounds, label="sampling")
    finally:
        for ctx, chains, _ in contexts.values():
            llama_cpp.llama_free(ctx)
            for chain in chains:  # the context only borrows them
                llama_cpp.llama_sampler_free(chain)
    return runs, outputs["numpy argmax"] == outputs["backend greedy"]
