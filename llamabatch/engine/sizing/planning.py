"""KV-cache memory planning: what llama.cpp will allocate, and how many sequences fit a budget.

The sizes mirror llama.cpp's own rules (llama-context.cpp, llama-kv-cache-iswa.cpp): the
context is padded to 256 cells; a per-sequence cache gives every sequence n_ctx / n_parallel
cells (padded); sliding-window layers keep only min(n_ctx_seq, n_swa + n_ubatch) cells per
stream (n_swa * n_parallel + n_ubatch when unified); every cell of a layer holds K and V for
its KV heads, each in its cache type (f16 by default; q8_0 is 34 bytes per 32 values).
Recurrent and hybrid models also keep a state per sequence, whatever its length, and
checkpoints of it (engine.memory) within their budget.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

from ...catalog import Catalog
from ...errors import ConfigError
from ..config import CHECKPOINT_MEMORY, unknown_cache_type
from ..native.handles import CACHE_TYPES, Batch, Context, Model
from ..native.backend import init_backend
from ..rpc import offloads

CELL_PAD = 256
PROBE_CELLS = 1024  # llama.cpp logs buffer sizes in MiB to 2 places: enough cells to read them to 1%


def pad(n: int) -> int:
    return -(-n // CELL_PAD) * CELL_PAD


@dataclass(frozen=True)
class KvShape:
    """What one KV cell costs in a model's layers, and which layers keep only a window."""

    full_layers: int
    swa_layers: int
    cell_bytes: float  # K + V of one layer for one cell (a quantized type packs values in blocks)
    n_swa: int  # the window, in tokens (0 = no sliding-window layers)
    state_bytes: int = 0  # recurrent and hybrid models: one sequence's state (what a checkpoint of it costs)

    @classmethod
    def of(cls, model: Model, cache_type_k: str = "f16", cache_type_v: str = "f16") -> KvShape:
        if model.is_recurrent or model.is_hybrid:
            return cls.measured(model, cache_type_k, cache_type_v)
        h = model.handle
        arch = model.meta("general.architecture")
        head_default = llama_cpp.llama_model_n_embd(h) // llama_cpp.llama_model_n_head(h)
        k = int(model.meta(f"{arch}.attention.key_length") or head_default)
        v = int(model.meta(f"{arch}.attention.value_length") or head_default)
        n_layer = llama_cpp.llama_model_n_layer(h)
        # Unknown layer kinds count as full-size: an upper bound, safe for planning.
        n_swa_layers = sum(model.swa_layers) if model.swa_layers else 0
        return cls(
            full_layers=n_layer - n_swa_layers, swa_layers=n_swa_layers,
            cell_bytes=llama_cpp.llama_model_n_head_kv(h) * (k * CACHE_TYPES[cache_type_k][1] + v * CACHE_TYPES[cache_type_v][1]),
            n_swa=llama_cpp.llama_model_n_swa(h) if n_swa_layers else 0,
        )

    @classmethod
    def measured(cls, model: Model, cache_type_k: str = "f16", cache_type_v: str = "f16") -> KvShape:
        """Which layers of a recurrent or hybrid model attend is not in llama.h, nor what its state
        holds: a one-sequence context tells both, the KV cache it allocates and a sequence's state
        (of one token: the state's size does not grow)."""
        with Context(model, n_ctx=PROBE_CELLS, n_batch=1, n_ubatch=1, n_seq_max=1, n_threads=1, kv_unified=True,
                     cache_type_k=cache_type_k, cache_type_v=cache_type_v) as ctx, Batch(1) as batch:
            batch.set([max(model.vocab.bos, 0)], [0], [0], [0])
            ctx.decode(batch)
            state = len(ctx.state(0, partial=True))
            layers = ctx.kv_layers
            kv = ctx.kv_bytes - state  # the state buffer holds one sequence's
            return cls(full_layers=layers, swa_layers=0, cell_bytes=max(0, kv) / ctx.n_ctx / layers if layers else 0.0,
                       n_swa=0, state_bytes=state)

    @property
    def checkpointed(self) -> bool:
        """Whether the engine keeps checkpoints of this model's memory (engine.memory.Memory.checkpointing)."""
        return bool(self.state_bytes or self.swa_layers)

    @property
    def bytes_per_token(self) -> int:
        """What each token of context costs in the full-attention layers (windows are bounded)."""
        return round(self.full_layers * self.cell_bytes)

    def cells(self, n_ctx: int, n_parallel: int, kv_unified: bool, n_ubatch: int) -> tuple[int, int]:
        """Cells llama.cpp allocates per full-attention layer and per sliding-window layer."""
        streams = 1 if kv_unified else n_parallel
        n_ctx_seq = pad(n_ctx) if kv_unified else pad(pad(n_ctx) // n_parallel)
        window = pad(min(n_ctx_seq, self.n_swa * (n_parallel if kv_unified else 1) + n_ubatch))
        return n_ctx_seq * streams, window * streams if self.swa_layers else 0

    def kv_bytes(self, n_ctx: int, n_parallel: int, kv_unified: bool, n_ubatch: int) -> int:
        """The KV cache and, for recurrent layers, a state per sequence."""
        full, swa = self.cells(n_ctx, n_parallel, kv_unified, n_ubatch)
        return round((full * self.full_layers + swa * self.swa_layers) * self.cell_bytes) + n_parallel * self.state_bytes


@dataclass(frozen=True)
class Plan:
    """How many sequences of ctx_per_seq tokens fit a memory budget, and what each part costs."""

    ctx_per_seq: int
    n_parallel: int
    kv_unified: bool
    model_bytes: int
    kv_bytes: int
    compute_bytes: int  # llama.cpp's graph buffer, estimated: the logits of one ubatch dominate
    output_bytes: int  # one row of logits per sequence
    process_bytes: int  # what this process used before loading the model (Python, libraries)
    budget_bytes: int
    checkpoint_bytes: int = 0  # recurrent, hybrid and sliding-window models: the host memory their checkpoints may hold
    prompt_cache_bytes: int = 0  # the prompt cache's RAM tier (--cache-ram)

    @property
    def n_ctx(self) -> int:
        return self.ctx_per_seq * self.n_parallel

    @property
    def total_bytes(self) -> int:
        return (self.model_bytes + self.kv_bytes + self.compute_bytes + self.output_bytes + self.process_bytes
                + self.checkpoint_bytes + self.prompt_cache_bytes)


def plan(
    model: Model, shape: KvShape, ctx_per_seq: int, budget_bytes: int, *,
    kv_unified: bool = False, n_ubatch: int = 512, max_parallel: int | None = None, process_bytes: int = 0,
    checkpoint_memory: int = CHECKPOINT_MEMORY, cache_ram: int = 0,
) -> Plan:
    """The largest n_parallel (at least 1) whose model, KV cache and buffers fit in budget_bytes."""
    limit = llama_cpp.llama_max_parallel_sequences()
    ctx_per_seq = pad(ctx_per_seq)
    n_vocab = model.vocab.n_vocab
    # llama.cpp's graph buffer holds one ubatch's logits plus activations that it reuses:
    # measured 514.5 MiB for Gemma 3 270M at n_ubatch 512, 512 MiB of it logits and 2.5 MiB
    # (2 floats of n_embd per token) the rest; 4 floats of n_embd per token leave a margin.
    compute = 4 * n_ubatch * (n_vocab + 4 * llama_cpp.llama_model_n_embd(model.handle))

    def at(n: int) -> Plan:
        return Plan(
            ctx_per_seq, n, kv_unified, model.size_bytes, shape.kv_bytes(ctx_per_seq * n, n, kv_unified, n_ubatch),
            compute, 4 * n_vocab * n, process_bytes, budget_bytes, checkpoint_memory if shape.checkpointed else 0, cache_ram,
        )

    best = at(1)
    for n in range(2, min(limit, max_parallel or limit) + 1):
        candidate = at(n)
        if candidate.total_bytes > budget_bytes:
            break
        best = candidate
    return best


def plan_for(
    model: str | Path | None = None, *, catalog: str | Path | None = None, ctx_per_seq: int | None = None,
    memory: int | None = None, kv_unified: bool = False, n_ubatch: int | None = None,
    max_parallel: int | None = None, cache_type_k: str | None = None, cache_type_v: str | None = None,
    rpc: str | None = None, checkpoint_memory: int | None = None, cache_ram: int = 0, verbose: bool = False,
) -> tuple[Plan, KvShape]:
    """Plan a catalog model (or GGUF path): by default each sequence gets the catalog's
    per-sequence context, and the budget is the memory available now plus what this process
    already holds. The budget covers the whole process: Python and its libraries too."""
    for option, value in (("cache_type_k", cache_type_k), ("cache_type_v", cache_type_v)):
        if value is not None and value not in CACHE_TYPES:
            raise ConfigError(unknown_cache_type(option, value))
    spec = Catalog.load(catalog).resolve(model)
    if memory is None and (rpc or spec.rpc) and spec.gpu_layers != 0:
        raise ConfigError("with --rpc the KV cache lives on the remote hosts: give --memory, theirs to plan for")
    if memory is None and offloads(spec.gpu_layers):
        raise ConfigError("this llama.cpp offloads to a GPU: give --memory, the GPU memory to plan for")
    init_backend(verbose)
    process = current_rss()
    with Model(spec.gguf_path(), gpu_layers=0) as loaded:
        loaded.check_supported()
        shape = KvShape.of(loaded, cache_type_k or "f16", cache_type_v or "f16")
        result = plan(
            loaded, shape, ctx_per_seq or spec.n_ctx // spec.parallel, memory or available_memory() + process,
            kv_unified=kv_unified, n_ubatch=n_ubatch or spec.n_ubatch, max_parallel=max_parallel, process_bytes=process,
            checkpoint_memory=CHECKPOINT_MEMORY if checkpoint_memory is None else checkpoint_memory, cache_ram=cache_ram,
        )
    if result.total_bytes > result.budget_bytes:
        raise ConfigError(
            f"even one sequence of {result.ctx_per_seq} tokens needs {result.total_bytes / 2**30:.2f} GiB, "
            f"more than the {result.budget_bytes / 2**30:.2f} GiB budget"
        )
    return result, shape


def current_rss() -> int:
    """This process's resident memory now (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def available_memory() -> int:
    """Memory this process can use now: MemAvailable on Linux, else all physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
