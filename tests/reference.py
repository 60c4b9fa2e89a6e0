"""A greedy batched decoding loop written straight against llama_cpp, to check the engine against.

All prompts are prefilled in the first batch (logits on each prompt's last token), then each
step decodes one token per sequence, seq_id = prompt position, and takes the argmax.
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np


def reference_greedy(
    model_path, prompts: list[list[int]], n_steps: int, *, n_ctx: int, n_batch: int, n_threads: int,
    lora: list[tuple[str, float]] = (),
) -> list[list[int]]:
    """`lora`: (adapter path, scale) pairs, loaded and set on the context here, as llama.cpp's tools do."""
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, n_batch, n_batch
    cparams.n_seq_max = len(prompts)
    cparams.n_threads = cparams.n_threads_batch = n_threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
    adapters = [llama_cpp.llama_adapter_lora_init(model, str(path).encode()) for path, _ in lora]
    try:
        if adapters:
            assert all(adapters)
            handles = (llama_cpp.llama_adapter_lora_p_ctypes * len(adapters))(*adapters)
            scales = (ctypes.c_float * len(lora))(*(scale for _, scale in lora))
            assert llama_cpp.llama_set_adapters_lora(ctx, handles, len(adapters), scales) == 0
        rows, n = [], 0
        for seq_id, tokens in enumerate(prompts):
            for pos, token in enumerate(tokens):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
                batch.seq_id[n][0] = seq_id
                batch.logits[n] = pos == len(tokens) - 1
                n += 1
            rows.append(n - 1)
        batch.n_tokens = n
        outputs: list[list[int]] = [[] for _ in prompts]
        for step in range(n_steps):
            assert llama_cpp.llama_decode(ctx, batch) == 0
            for seq_id, row in enumerate(rows):
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, row), shape=(n_vocab,))
                outputs[seq_id].append(int(np.argmax(logits)))
            for seq_id, tokens in enumerate(prompts):
                batch.token[seq_id] = outputs[seq_id][-1]
                batch.pos[seq_id] = len(tokens) + step
                batch.n_seq_id[seq_id] = 1
                batch.seq_id[seq_id][0] = seq_id
                batch.logits[seq_id] = 1
            batch.n_tokens = len(prompts)
            rows = list(range(len(prompts)))
        return outputs
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        for adapter in adapters:
            llama_cpp.llama_adapter_lora_free(adapter)
        llama_cpp.llama_model_free(model)


def _logits_alone(model_path, tokens: list[int], rows: list[int], *, n_ctx: int, n_threads: int) -> list[np.ndarray]:
    """The whole list decoded alone in one batch: the logits of each of `rows` (copies)."""
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = n_ctx, len(tokens), len(tokens), 1
    cparams.n_threads = cparams.n_threads_batch = n_threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    wanted = set(rows)
    try:
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, i in wanted
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(tokens)
        assert llama_cpp.llama_decode(ctx, batch) == 0
        return [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy() for i in rows]
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def reference_prompt_logprobs(model_path, tokens: list[int], *, n_ctx: int = 2048, n_threads: int = 2) -> list[tuple[float, bool]]:
    """For each token after the first: its log-probability given the ones before it, and whether
    it was (one of) the most likely; the whole list decoded alone in one batch, logits on every row."""
    rows = _logits_alone(model_path, tokens, list(range(len(tokens) - 1)), n_ctx=n_ctx, n_threads=n_threads)
    out = []
    for row, target in zip(rows, tokens[1:]):
        row = row.astype(np.float64)
        log_total = row.max() + np.log(np.exp(row - row.max()).sum())
        out.append((float(row[target] - log_total), bool(row[target] >= row.max())))
    return out


def reference_next_logits(model_path, tokens: list[int], *, n_ctx: int = 2048, n_threads: int = 2) -> np.ndarray:
    """The logits after the whole list, decoded alone."""
    return _logits_alone(model_path, tokens, [len(tokens) - 1], n_ctx=n_ctx, n_threads=n_threads)[0]


def batch_seq_ids(batch) -> list[int]:
    """Each row's seq_id in an engine's batch, as llama.cpp reads it (through the row's pointer)."""
    rows = batch.handle.seq_id
    return [rows[i][0] for i in range(batch.n_tokens)]


_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data


def reference_distribution(logits: np.ndarray, top_k: int, top_p: float, min_p: float, temperature: float) -> dict[int, float]:
    """llama.cpp's own samplers (top-k, top-p, min-p, temperature, in its order) applied to a row of
    logits, without the draw: each token left, and its probability."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    try:
        for sampler in (llama_cpp.llama_sampler_init_top_k(top_k), llama_cpp.llama_sampler_init_top_p(top_p, 1),
                        llama_cpp.llama_sampler_init_min_p(min_p, 1), llama_cpp.llama_sampler_init_temp(temperature)):
            llama_cpp.llama_sampler_chain_add(chain, sampler)
        cells = np.zeros(len(logits), dtype=_TOKEN_DATA)
        cells["id"], cells["logit"] = np.arange(len(logits), dtype=np.int32), logits
        array = llama_cpp.llama_token_data_array(cells.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), len(cells), -1, False)
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(array))
        kept = cells[: array.size]
        weights = np.exp(kept["logit"].astype(np.float64) - kept["logit"].max())
        return dict(zip(kept["id"].tolist(), (weights / weights.sum()).tolist()))
    finally:
        llama_cpp.llama_sampler_free(chain)


def reference_penalties(logits: np.ndarray, tokens: list[int], last_n: int, repeat: float, frequency: float, presence: float) -> np.ndarray:
    """llama.cpp's penalties sampler, having accepted `tokens`, applied to a row of logits."""
    sampler = llama_cpp.llama_sampler_init_penalties(len(logits), last_n, repeat, frequency, presence)
    try:
        for token in tokens:
            llama_cpp.llama_sampler_accept(sampler, token)
        cells = np.zeros(len(logits), dtype=_TOKEN_DATA)
        cells["id"], cells["logit"] = np.arange(len(logits), dtype=np.int32), logits
        array = llama_cpp.llama_token_data_array(cells.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), len(cells), -1, False)
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
        out = np.empty(len(logits), dtype=np.float32)
        out[cells["id"][: array.size]] = cells["logit"][: array.size]
        return out
    finally:
        llama_cpp.llama_sampler_free(sampler)
