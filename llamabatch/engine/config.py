"""Engine settings: the catalog's defaults for a model, overridden by the caller, validated."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import llama_cpp

from ..catalog import ModelSpec
from ..errors import ConfigError
from .native.handles import CACHE_TYPES, FLASH_ATTN
from .rpc import offloads, parse_endpoints, parse_tensor_split

UNQUANTIZED = ("f32", "f16", "bf16")  # cache types that need no flash attention


def unknown_cache_type(option: str, value: str) -> str:
    return f"--{option.replace('_', '-')} must be one of {', '.join(CACHE_TYPES)}, got {value!r}"


# llama.cpp rounds each sequence's share of a non-unified KV cache up to a multiple of
# 256 cells, so a smaller share silently allocates more memory than --ctx asked for.
KV_CELLS_PER_SEQUENCE_MIN = 256
# Tokens packed into one embedding decode. Packed texts are masked from each other, but attention
# still spans every row of the decode: on the CPU a pack of 256 tokens embedded the tests' tiny
# model 3x faster than one of 2048 (73k vs 24k tokens/s); Gemma 3 270M, whose matrices dominate,
# ran at the same speed with either. llama.cpp's vectors move with the packing (cosine 0.99972
# between llama-embedding -c 256 and -c 2048 on Gemma): set 2048 to get llama-embedding's own.
EMBED_PACK_TOKENS = 256
RPC_TIMEOUT_S = 600.0  # --rpc-timeout's default
# Recurrent and hybrid memory cannot drop a suffix, so a prefix is reused from checkpoints of its
# state: one every CHECKPOINT_EVERY prompt tokens (a prefix shared with an earlier prompt then costs
# at most that many tokens more than on a plain model; shorter prompt chunks are the price), kept
# in at most CHECKPOINT_MEMORY of host memory over all slots. docs/guides/model-families.md.
CHECKPOINT_EVERY = 64
# A sliding window's checkpoint holds the whole window (Gemma 3 270M: 512 positions and the chunk read last, 7.5 MiB),
# so windows are checkpointed every half window, at least WINDOW_CHECKPOINT_EVERY prompt tokens:
# the first prompt to reuse a 2,000-token prefix whose slot went to other work then reads at most
# that many tokens again (its first token in 0.19x a cold one's time from the RAM tier, against
# 0.32x with checkpoints every 512 tokens and no gain at all with checkpoints at prompt ends only:
# `python -m benchmarks prompt_cache`); a cold prefill pays about 2% for the shorter chunks and
# the copies.
WINDOW_CHECKPOINT_EVERY = 256
CHECKPOINT_MEMORY = 1 << 30
# The prompt cache's disk tier when --cache-dir is given without --cache-disk.
CACHE_DISK = 8 << 30


@dataclass(frozen=True)
class EngineConfig:
    """An engine's settings: the one list of them, which BatchEngine takes as keyword arguments
    and the command line's options map onto (engine.options). The sizes have no defaults here:
    they are the model's, from its catalog entry (ModelSpec), so `for_model` is the way to make one."""

    n_ctx: int  # total KV cells, split evenly between sequences unless kv_unified
    n_batch: int  # most tokens per llama_decode
    n_ubatch: int
    n_parallel: int  # slots: sequences decoded together
    n_threads: int  # 0 = all cores
    gpu_layers: int  # -1 = all
    # One KV buffer shared by all sequences, not one each. With one each, llama.cpp splits a step
    # whose sequences bring different token counts (a prompt beside decoding ones: the normal
    # case once they end at different times) into several graph runs: 1.2-1.9x slower measured
    # (`python -m benchmarks kv_layout`). Deterministic mode needs one each.
    kv_unified: bool = True
    share_prefixes: bool = True  # copy common prompt prefixes' KV instead of decoding them again
    deterministic: bool = False  # a sequence's output does not depend on what else is in the batch
    # Speculative decoding ("ngram": prompt lookup; "draft": draft_model, a catalog name or a
    # GGUF path; "off"): sequences propose up to draft_max tokens each, verified in the step's
    # one decode, where measuring says drafts pay (planner.DraftPlanner;
    # docs/guides/speculative.md).
    speculative: str = "off"
    draft_model: str | None = None
    draft_max: int = 15  # with its last token, 16 rows: a multiple of the CPU kernels' 4-row tile
    # Seconds a step that reads prompt tokens beside decoding sequences keeps to (scheduling.budget),
    # the prompts being read sharing it; "auto": a few decode steps' time; 0: none, whole n_batch
    # chunks in admission order (the default: offline work wants throughput; serve sets auto). A
    # duration's text ("100ms", "off") is read too.
    step_target: float | str = 0.0
    # Decode the next plain step before this one's tokens are accepted (text, stop strings,
    # events), so that the host's bookkeeping runs while the device computes: "auto" where
    # llama_decode returns before the device is done (layers on a GPU), "on", "off". Only where
    # memory can be cut (a token decoded past a stop string is cut off again), and never with
    # speculation or in deterministic mode, which keep the plain order (Stepper.runs_ahead).
    overlap: str = "auto"
    # Prompt tokens between checkpoints of memory that cannot be cut (0: at prompt ends only; None:
    # the family's, CHECKPOINT_EVERY or a window's: Runtime.checkpoint_every).
    checkpoint_every: int | None = None
    checkpoint_memory: int = CHECKPOINT_MEMORY  # bytes of host memory for them (0: none kept)
    embed_pack: int = EMBED_PACK_TOKENS  # tokens packed into one embedding decode
    # The prompt cache (engine.prompt_cache): host memory for the memory of prompts whose slot
    # was taken (0: none), and a folder that keeps them across restarts, within cache_disk bytes.
    cache_ram: int = 0
    cache_dir: str | None = None
    cache_disk: int = CACHE_DISK
    # "priority": admission by priority (aged), preempting worse-ranked sequences for better
    # ones; "fcfs": submission order, no preemption (vLLM's --scheduling-policy). Sequences of
    # one priority (every command but serve) run in submission order under both.
    scheduling: str = "priority"
    # LoRA adapters (PATH[:SCALE], or NAME[:SCALE] of one the catalog declares for the model):
    # loaded with the model and applied to every sequence that does not choose its own.
    lora: tuple[str, ...] = ()
    # KV cache element types (llama.cpp's -ctk/-ctv) and flash attention, which a quantized V
    # cache needs: q8_0 stores 8.5 bits a value instead of f16's 16, so about 1.9x the tokens fit.
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"  # "auto": llama.cpp turns it on where the backend supports it
    # Layers on other hosts (llama.cpp's RPC backend): their rpc-servers' HOST:PORT, and each
    # device's share of the offloaded layers, remotes first, then local GPUs (llama.cpp's order).
    rpc: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    # ggml waits for a remote without a timeout: a decode unanswered this long means the host is
    # gone (not merely slow), and the process exits as when a connection breaks. None: 600 s.
    rpc_timeout: float | None = None
    chat: bool = False
    # The chat template: a Jinja file, or a llama.cpp built-in's name; None: the GGUF's own, else
    # the catalog's built-in for GGUFs without one.
    chat_template: str | None = None
    mmproj: str | None = None  # a multimodal projector GGUF: prompts may show images
    mmproj_offload: bool = True  # the projector on the GPU, where the text model's layers are
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.n_threads == 0:
            object.__setattr__(self, "n_threads", os.cpu_count() or 1)
        object.__setattr__(self, "lora", tuple(str(text) for text in self.lora))
        for name in ("draft_model", "cache_dir", "chat_template", "mmproj"):  # paths are kept as text
            if getattr(self, name) is not None:
                object.__setattr__(self, name, str(getattr(self, name)))
        object.__setattr__(self, "rpc", parse_endpoints(self.rpc))
        object.__setattr__(self, "tensor_split", parse_tensor_split(self.tensor_split))
        object.__setattr__(self, "checkpoint_memory", size_option(self.checkpoint_memory, "--checkpoint-memory"))
        object.__setattr__(self, "cache_ram", size_option(self.cache_ram, "--cache-ram"))
        object.__setattr__(self, "cache_disk", size_option(self.cache_disk, "--cache-disk"))
        object.__setattr__(self, "step_target", step_target_option(self.step_target))
        for problem in self._problems():
            raise ConfigError(problem)

    @classmethod
    def for_model(cls, spec: ModelSpec, **overrides) -> EngineConfig:
        """The spec's defaults, with every override that is not None applied."""
        values = dict(
            n_ctx=spec.n_ctx, n_batch=spec.n_batch, n_ubatch=spec.n_ubatch, n_parallel=spec.parallel,
            n_threads=spec.threads, gpu_layers=spec.gpu_layers, chat=spec.chat, rpc=spec.rpc,
            tensor_split=spec.tensor_split, mmproj=spec.mmproj,
        )
        unknown = sorted(set(overrides) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"unknown engine settings {unknown}: an engine takes EngineConfig's fields "
                            f"({', '.join(f.name for f in fields(cls))})")
        given = {k: v for k, v in overrides.items() if v is not None}
        if "draft_model" in given:
            given.setdefault("speculative", "draft")  # naming a draft model asks for it
        if given.get("deterministic"):
            # per-sequence KV and no partial prefix copies: both change a sequence's arithmetic
            values.update(kv_unified=False, share_prefixes=False)
        values.update(given)
        return cls(**values)

    def _problems(self):
        for name in ("n_ctx", "n_batch", "n_ubatch", "n_parallel", "n_threads"):
            if getattr(self, name) < 1:
                yield f"{name} must be >= 1, got {getattr(self, name)}"
        if self.embed_pack < 1:
            yield f"--embed-pack must be >= 1 token, got {self.embed_pack}"
        max_seq = llama_cpp.llama_max_parallel_sequences()
        if self.n_parallel > max_seq:
            yield f"--parallel {self.n_parallel} exceeds llama.cpp's limit of {max_seq} sequences"
        elif not self.kv_unified and self.n_ctx // self.n_parallel < KV_CELLS_PER_SEQUENCE_MIN:
            yield (
                f"--parallel {self.n_parallel} leaves {self.n_ctx // self.n_parallel} KV cells per sequence "
                f"(--ctx {self.n_ctx}), and llama.cpp gives each at least {KV_CELLS_PER_SEQUENCE_MIN}: "
                f"use --ctx {self.n_parallel * KV_CELLS_PER_SEQUENCE_MIN}, "
                f"--parallel {max(1, self.n_ctx // KV_CELLS_PER_SEQUENCE_MIN)}, or --kv-unified"
            )
        elif self.n_ctx < self.n_parallel:
            yield f"--parallel {self.n_parallel} is more than --ctx {self.n_ctx} KV cells"
        if self.n_batch < self.n_parallel:
            yield f"n_batch ({self.n_batch}) must be at least --parallel ({self.n_parallel}): each sequence adds a token per step"
        if self.deterministic and self.n_batch < 2:
            yield "--deterministic needs n_batch >= 2: a lone sequence may decode beside a filler token"
        if self.deterministic and self.kv_unified:
            yield "--deterministic needs a per-sequence KV cache: drop --kv-unified"
        if self.deterministic and self.share_prefixes:
            yield "--deterministic copies no prompt prefixes: drop --share-prefixes"
        if self.deterministic and self.rpc:
            yield "--deterministic is verified on this host's CPU only: drop --rpc"
        elif self.deterministic and offloads(self.gpu_layers):
            yield "--deterministic is verified on CPU builds only: add --gpu-layers 0"
        if self.speculative not in ("off", "ngram", "draft"):
            yield f"--speculative must be 'ngram', 'draft' or 'off', got {self.speculative!r}"
        if self.speculative == "draft" and not self.draft_model:
            yield "--speculative draft needs --draft-model NAME|PATH"
        if self.draft_model and self.speculative != "draft":
            yield f"--draft-model drafts with --speculative draft, not {self.speculative!r}"
        if self.mmproj and self.speculative == "draft":
            yield "--speculative draft with --mmproj: a draft model reads no images or audio (--speculative ngram drafts from the prompt's text)"
        if self.deterministic and self.speculative != "off":
            yield "--deterministic decodes one token per sequence a step: drop --speculative"
        if self.overlap not in ("auto", "on", "off"):
            yield f"--overlap must be 'auto', 'on' or 'off', got {self.overlap!r}"
        if self.scheduling not in ("priority", "fcfs"):
            yield f"--scheduling-policy must be 'priority' or 'fcfs', got {self.scheduling!r}"
        if self.draft_max < 1:
            yield f"--draft-max must be >= 1, got {self.draft_max}"
        if self.step_target != "auto" and self.step_target < 0:
            yield f"--step-target must be a duration, auto or off, got {self.step_target} s"
        if self.checkpoint_every is not None and self.checkpoint_every < 0:
            yield f"--checkpoint-every must be >= 0 tokens (0: checkpoints only at prompt ends), got {self.checkpoint_every}"
        for option, value in (("--checkpoint-memory", self.checkpoint_memory), ("--cache-ram", self.cache_ram),
                              ("--cache-disk", self.cache_disk)):
            if value < 0:
                yield f"{option} must be >= 0, got {value}"
        if (self.cache_ram or self.cache_dir) and not self.share_prefixes:
            yield "the prompt cache (--cache-ram, --cache-dir) keeps prefixes for reuse: it needs shared prefixes (drop --deterministic or --no-share-prefixes)"
        for name in ("cache_type_k", "cache_type_v"):
            if getattr(self, name) not in CACHE_TYPES:
                yield unknown_cache_type(name, getattr(self, name))
        if self.flash_attn not in FLASH_ATTN:
            yield f"--flash-attn must be 'auto', 'on' or 'off', got {self.flash_attn!r}"
        elif self.flash_attn == "off" and self.cache_type_v in CACHE_TYPES and self.cache_type_v not in UNQUANTIZED:
            yield f"a quantized V cache (--cache-type-v {self.cache_type_v}) needs flash attention: use --flash-attn auto or on"
        if self.rpc_timeout is not None and not self.rpc:
            yield "--rpc-timeout applies to remotes: add --rpc, or drop --rpc-timeout"
        elif self.rpc_timeout is not None and self.rpc_timeout <= 0:
            yield f"--rpc-timeout must be > 0 seconds, got {self.rpc_timeout}"
        if self.tensor_split and not self.rpc and not offloads(self.gpu_layers):
            # llama.cpp would ignore the shares: nothing is offloaded to share
            yield "--tensor-split shares offloaded layers between devices, and this engine has none: add --rpc, or drop --tensor-split"
        if self.gpu_layers < -1:
            yield f"gpu_layers must be -1 (all) or >= 0, got {self.gpu_layers}"


def step_target_option(value: float | str) -> float | str:
    """--step-target: seconds (a number, or a duration such as 150ms), "auto", or "off" (0)."""
    if not isinstance(value, str):
        return float(value)
    text = value.strip().lower()
    if text in ("auto", "off", "0"):
        return "auto" if text == "auto" else 0.0
    try:
        return parse_duration(text)
    except ValueError as e:
        raise ConfigError(f"--step-target: {e}; or auto, or off") from None


def size_option(value: int | str, option: str) -> int:
    """A memory budget `option` in bytes: a number, or a size such as 512MiB (0: none)."""
    if not isinstance(value, str):
        return value
    try:
        return parse_size(value, zero=True)
    except ValueError as e:
        raise ConfigError(f"{option}: {e}") from None


def parse_size(text: str, zero: bool = False) -> int:
    """'4GiB', '512MiB', '2GB', '1500000000' -> bytes (0 only where `zero` allows it)."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number):].lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value < 0 or (value == 0 and not zero):
        raise ValueError(f"not a memory size: {text!r} (write e.g. 4GiB, 512MiB or 2GB)")
    return int(value * units[unit])


def parse_duration(text: str) -> float:
    """'150ms', '0.15s', '0.15' -> seconds (> 0)."""
    raw = text.strip().lower()
    scale, number = (1e-3, raw[:-2]) if raw.endswith("ms") else (1.0, raw.removesuffix("s"))
    try:
        value = float(number) * scale
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"not a duration: {text!r} (write e.g. 150ms or 0.15s)")
    return value
