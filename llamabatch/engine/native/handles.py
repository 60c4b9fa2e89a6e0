"""Owners of llama.cpp's native handles: model, context, batch and LoRA adapter.

Each class holds one handle and frees it exactly once in close() (or on leaving a
`with` block); __del__ is only a backstop. The vocabulary is borrowed from its model.
"""

from __future__ import annotations

import ctypes
import functools
import re
from collections.abc import Sequence
from pathlib import Path

import llama_cpp
import numpy as np

from ...errors import ConfigError, DecodeError, LlamabatchError, ModelError, PromptError
from . import backend
from .backend import awaiting_backends

KV_FULL = 1  # llama_decode's "no free KV slot" (DecodeError.code)
INVALID_BATCH = -1  # llama_decode refused the batch before computing anything (positions, ids, ...)
# llama_get_logits returning the address as an int: the binding's POINTER result costs a ctypes
# object and its .contents another, every step.
_logits_address = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(ctypes.cast(llama_cpp.llama_get_logits, ctypes.c_void_p).value)
# Steps of a plain step that repeats whose positions Batch.set_next writes at once.
POSITIONS_AHEAD = 64
_STEPS_AHEAD = np.arange(1, POSITIONS_AHEAD + 1, dtype=np.int32)[:, None]  # added to the positions in use


class _Owner:
    """Holds a native handle until close()."""

    kind = "handle"
    _handle = None  # so close() is safe even when a constructor failed before setting it

    def __init__(self, handle) -> None:
        self._handle = handle

    @property
    def handle(self):
        if self._handle is None:
            raise LlamabatchError(f"{self.kind} is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._free(handle)

    def _free(self, handle) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class Vocab:
    """Tokenizer of a model; borrowed, valid while the model is open."""

    def __init__(self, handle) -> None:
        self._handle = handle
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(handle)
        self.bos = llama_cpp.llama_vocab_bos(handle)
        self.eos = llama_cpp.llama_vocab_eos(handle)
        self.pad = llama_cpp.llama_vocab_pad(handle)  # -1: none
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(handle))
        self.sep = llama_cpp.llama_vocab_sep(handle)  # -1: none
        self.add_eos = bool(llama_cpp.llama_vocab_get_add_eos(handle))
        self.add_sep = bool(llama_cpp.llama_vocab_get_add_sep(handle))
        # fill-in-the-middle: prefix, suffix, middle, repository, file separator (-1: none)
        self.fim = tuple(f(handle) for f in (llama_cpp.llama_vocab_fim_pre, llama_cpp.llama_vocab_fim_suf, llama_cpp.llama_vocab_fim_mid,
                                             llama_cpp.llama_vocab_fim_rep, llama_cpp.llama_vocab_fim_sep))
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """`parse_special`: text such as "<eos>" becomes the special token (False: plain text, as
        code around a gap to fill is read)."""
        data = text.encode()
        capacity = len(data) + 8
        while True:
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self._handle, data, len(data), buf, capacity, add_special, parse_special)
            if n >= 0:
                return buf[:n]
            capacity = -n  # too small: llama.cpp says how many it needs

    def piece(self, token: int) -> bytes:
        """The token's bytes (special tokens render empty). Cached: the hot path asks often."""
        cached = self._pieces.get(token)
        if cached is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self._handle, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self._handle, token, buf, len(buf), 0, False)
            cached = self._pieces[token] = buf.raw[:n]
        return cached

    def text(self, token: int) -> str | None:
        """A token's text as the vocabulary stores it, special tokens included ("<eos>"); None for none."""
        if token < 0:
            return None
        return llama_cpp.llama_vocab_get_text(self._handle, token).decode(errors="replace")

    def detokenize(self, tokens: list[int]) -> str:
        """Text of token ids; an id outside the vocabulary is refused (llama.cpp would abort)."""
        self.check_ids(tokens)
        return b"".join(self.piece(t) for t in tokens).decode(errors="replace")

    def check_ids(self, tokens: list[int]) -> None:
        if not all(0 <= t < self.n_vocab for t in tokens):
            raise PromptError(f"token ids outside the vocabulary [0, {self.n_vocab})")

    @property
    def handle(self):
        return self._handle

    def eog_tokens(self) -> list[int]:
        """Every token that ends generation (EOS, end-of-turn, ...); a scan of the vocabulary."""
        return [t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._handle, t)]

    @functools.cached_property
    def eog_ids(self) -> tuple[int, ...]:
        """eog_tokens, scanned once (min_tokens bans them in every row that asks)."""
        return tuple(self.eog_tokens())

    def is_eog(self, token: int) -> bool:
        """Whether the token ends generation (EOS, EOT, ...). Cached, as pieces are."""
        eog = self._eog.get(token)
        if eog is None:
            eog = self._eog[token] = llama_cpp.llama_vocab_is_eog(self._handle, token)
        return eog


class Model(_Owner):
    kind = "model"

    def __init__(
        self, path: Path, gpu_layers: int = -1, repack: bool = True, devices: Sequence[int] = (),
        tensor_split: Sequence[float] = (),
    ) -> None:
        """`devices` (ggml device handles) replace llama.cpp's default choice of where offloaded
        layers go; `tensor_split` gives each of them its share, in that order."""
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = gpu_layers
        params.use_extra_bufts = repack  # CPU weight repacking: faster, but kernels differ by row count
        if devices:
            listed = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)  # NULL-terminated
            params.devices = ctypes.cast(listed, ctypes.c_void_p)
        if tensor_split:
            if devices and len(tensor_split) > len(devices):
                raise ConfigError(f"--tensor-split gives {len(tensor_split)} shares for {len(devices)} devices")
            shares = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*tensor_split)
            params.tensor_split = shares
        with backend.log.capture() as log:
            handle = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not handle:
            raise ModelError(f"llama.cpp could not load {path} (corrupt or unsupported GGUF; --verbose shows why)")
        super().__init__(handle)
        self.path = path
        self.vocab = Vocab(llama_cpp.llama_model_get_vocab(handle))
        # Where each layer went and which use sliding-window attention are not in llama.h; the
        # loader logs them ("layer 3 assigned to device RPC0, is_swa = 1"; the output layer last).
        assigned = [(m[1], m[2] == "1") for m in re.finditer(r"layer +\d+ assigned to device (\S+), is_swa = (\d)", "\n".join(log))]
        n_layer = llama_cpp.llama_model_n_layer(handle)
        self.placement: list[str] = [device for device, _ in assigned]
        self.swa_layers: list[bool] | None = [swa for _, swa in assigned[:n_layer]] if len(assigned) >= n_layer else None

    def _free(self, handle) -> None:
        llama_cpp.llama_model_free(handle)

    @property
    def description(self) -> str:
        buf = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self.handle, buf, len(buf))
        return buf.value.decode()

    @property
    def n_params(self) -> int:
        return llama_cpp.llama_model_n_params(self.handle)

    @property
    def size_bytes(self) -> int:
        return llama_cpp.llama_model_size(self.handle)

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text, or None when the model lacks the key."""
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    @property
    def float_weights(self) -> bool:
        """Weights stored as F32, F16 or BF16 (or a file that does not say): llamafile's sgemm
        multiplies them for two rows or more, ggml's vec_dot for one, rounding differently."""
        return self.meta("general.file_type") in (None, "0", "1", "32")

    @property
    def n_ctx_train(self) -> int:
        return llama_cpp.llama_model_n_ctx_train(self.handle)

    @property
    def is_recurrent(self) -> bool:
        """Mamba, RWKV and their kin: one state per sequence instead of a cache of positions."""
        return bool(llama_cpp.llama_model_is_recurrent(self.handle))

    @property
    def is_hybrid(self) -> bool:
        """Attention layers beside recurrent ones (Qwen3.5, LFM2, Granite 4 hybrid, Nemotron-H)."""
        return bool(llama_cpp.llama_model_is_hybrid(self.handle))

    def check_supported(self) -> None:
        """Refuse, naming the reason, a model llamabatch cannot run: one that needs llama_encode
        (T5; the draft heads EAGLE-3 and DFlash, which are not models of their own) or one that
        writes by denoising a block (diffusion: Dream, LLaDA, RND1). Both load and even decode,
        and would answer with garbage."""
        arch, name = self.meta("general.architecture"), self.path.name
        if llama_cpp.llama_model_is_diffusion(self.handle):
            raise ModelError(f"{name} is a diffusion model ({arch}): it writes a block of tokens by denoising it, "
                             "where llamabatch decodes one token after another (llama.cpp's llama-diffusion-cli runs it)")
        if llama_cpp.llama_model_has_encoder(self.handle):
            raise ModelError(f"{name} has an encoder ({arch}): it needs llama_encode before it decodes, "
                             "and llamabatch runs decoder-only models")

    def chat_template_text(self) -> str | None:
        """The GGUF's own chat template (Jinja text); None for a GGUF without one."""
        template = llama_cpp.llama_model_chat_template(self.handle, None)
        return template.decode(errors="replace") if template else None

    def apply_builtin_template(self, messages: list[dict[str, str]], name: str) -> str:
        """Render role/content messages with one of llama.cpp's built-in templates ("chatml",
        "gemma", ...), ending with the assistant's turn."""
        keep = [(m["role"].encode(), m["content"].encode()) for m in messages]  # alive across the calls
        chat = (llama_cpp.llama_chat_message * len(keep))(*(llama_cpp.llama_chat_message(r, c) for r, c in keep))
        size = 0
        buf = None
        while True:
            n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(keep), True, buf, size)
            if n < 0:
                raise ModelError(f"{name!r} is neither a Jinja file nor one of llama.cpp's built-in templates")
            if n <= size:
                return buf.raw[:n].decode()
            size = n
            buf = ctypes.create_string_buffer(size)


class LoraAdapter(_Owner):
    """A LoRA adapter loaded for a model; free it before the model (llama.cpp's model frees the
    adapters still attached to it, and a second free would be a double one)."""

    kind = "LoRA adapter"

    def __init__(self, model: Model, path: Path) -> None:
        with backend.log.capture() as log:
            handle = llama_cpp.llama_adapter_lora_init(model.handle, str(path).encode())
        if not handle:
            why = next((line.split("failed to apply lora adapter: ")[-1] for line in log if "failed to apply lora" in line), "")
            raise ModelError(f"llama.cpp could not load the LoRA adapter {path}: {why or 'see --verbose'}")
        super().__init__(handle)
        self.path = path

    def _free(self, handle) -> None:
        llama_cpp.llama_adapter_lora_free(handle)


# KV cache element types llama.cpp accepts for --cache-type-k/-v (llama-server's list), with
# their bytes per stored value: ggml's block bytes over block length.
CACHE_TYPES: dict[str, tuple[int, float]] = {
    "f32": (llama_cpp.GGML_TYPE_F32, 4.0), "f16": (llama_cpp.GGML_TYPE_F16, 2.0), "bf16": (30, 2.0),  # GGML_TYPE_BF16 (not bound)
    "q8_0": (llama_cpp.GGML_TYPE_Q8_0, 34 / 32), "q4_0": (llama_cpp.GGML_TYPE_Q4_0, 18 / 32),
    "q4_1": (llama_cpp.GGML_TYPE_Q4_1, 20 / 32), "iq4_nl": (llama_cpp.GGML_TYPE_IQ4_NL, 18 / 32),
    "q5_0": (llama_cpp.GGML_TYPE_Q5_0, 22 / 32), "q5_1": (llama_cpp.GGML_TYPE_Q5_1, 24 / 32),
}
FLASH_ATTN = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}


class Context(_Owner):
    kind = "context"

    def __init__(
        self, model: Model, *, n_ctx: int, n_batch: int, n_ubatch: int, n_seq_max: int,
        n_threads: int, kv_unified: bool, pooling: int | None = None,
        cache_type_k: str = "f16", cache_type_v: str = "f16", flash_attn: str = "auto", n_rs_seq: int = 0,
    ) -> None:
        """`pooling` (a llama_pooling_type) makes an embedding context: every row is an output,
        and each sequence's pooled vector is read with embedding(). `n_rs_seq` asks recurrent
        layers to keep the states after each of a decode's last n_rs_seq tokens, so those tokens
        can be removed again (llama.cpp keeps them only for architectures that support it)."""
        params = llama_cpp.llama_context_default_params()
        params.type_k, params.type_v = CACHE_TYPES[cache_type_k][0], CACHE_TYPES[cache_type_v][0]
        params.flash_attn_type = FLASH_ATTN[flash_attn]
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_ubatch, n_batch)
        params.n_seq_max = n_seq_max
        params.n_threads = params.n_threads_batch = n_threads
        params.kv_unified = kv_unified
        params.swa_full = False  # as llama.cpp's own tools: sliding-window layers keep only their window
        params.n_rs_seq = n_rs_seq
        params.no_perf = True
        if pooling is not None:
            params.embeddings = True
            params.pooling_type = pooling
        with backend.log.capture() as log:
            handle = llama_cpp.llama_init_from_model(model.handle, params)
        if not handle:
            # llama.cpp's refusals (a cache type the model's heads cannot take, ...) come last.
            refused = [line.split(": ", 1)[-1] for line in log if line.startswith("llama_init_from_model: ")]
            raise ConfigError(
                f"llama.cpp could not create a context: {refused[-1]}" if refused else
                f"llama.cpp could not create a context (n_ctx={n_ctx}, parallel={n_seq_max}, n_batch={n_batch}); "
                "lower --ctx or --parallel (--verbose shows why)"
            )
        super().__init__(handle)
        self.cache_types = (cache_type_k, cache_type_v)
        # What auto resolved to, as the context logs it (a quantized V cache turns it on before any probe).
        text = "\n".join(log)
        enabled = "Flash Attention enabled" in text or "enabling flash_attn" in text
        self.flash_attn = "off" if "Flash Attention not supported" in text else "on" if enabled else flash_attn
        self._memory = llama_cpp.llama_get_memory(handle)
        self.n_ctx = llama_cpp.llama_n_ctx(handle)
        self.n_ctx_seq = llama_cpp.llama_n_ctx_seq(handle)
        self.n_batch = llama_cpp.llama_n_batch(handle)  # llama.cpp caps it at n_ctx
        self.n_ubatch = llama_cpp.llama_n_ubatch(handle)
        self.kv_unified = kv_unified
        self.n_swa = llama_cpp.llama_model_n_swa(model.handle)
        self.n_rs_seq = llama_cpp.llama_n_rs_seq(handle)  # what llama.cpp granted (0 where unsupported)
        self._logits_views: dict[tuple[int, int], np.ndarray] = {}
        # The bytes llama.cpp allocated for the KV cache (all its caches, and recurrent layers'
        # states) and the layers the KV cache holds (a hybrid model's attention layers), as it reports them.
        self.kv_bytes = round(sum(float(m[1]) for m in re.finditer(r"(?:KV|RS) buffer size = +([\d.]+) MiB", text)) * 2**20)
        self.kv_layers = sum(int(m[1]) for m in re.finditer(r"llama_kv_cache: size = .*cells, +(\d+) layers", text))

    def _free(self, handle) -> None:
        llama_cpp.llama_free(handle)

    def set_adapters(self, adapters: list[LoraAdapter], scales: list[float]) -> None:
        """The LoRA adapters every later decode applies, each at its scale (none: the base model).
        One set per context: llama.cpp has no per-sequence adapters."""
        handles = (llama_cpp.llama_adapter_lora_p_ctypes * len(adapters))(*(a.handle for a in adapters))
        if llama_cpp.llama_set_adapters_lora(self.handle, handles, len(adapters), (ctypes.c_float * len(scales))(*scales)) != 0:
            raise ModelError("llama.cpp refused the LoRA adapter set (llama_set_adapters_lora)")

    def decode(self, batch: Batch) -> None:
        backend.process.decoded = True
        mark = backend.log.n_warnings
        code = awaiting_backends(llama_cpp.llama_decode, self.handle, batch.handle)
        if code != 0:
            raise DecodeError(code, backend.log.said_since(mark) or None)

    def output_logits(self, n_outputs: int, n_vocab: int) -> np.ndarray:
        """The last decode's logits, one row per batch row that asked for them, in batch order
        (llama.cpp puts its outputs back in that order first): a view, valid until the next decode.
        Views are kept per (address, rows): llama.cpp reuses its buffer, and building a view costs
        more than a small model's whole sampling step."""
        address = awaiting_backends(_logits_address, self.handle)
        view = self._logits_views.get((address, n_outputs))
        if view is None:
            rows = (ctypes.c_float * (n_outputs * n_vocab)).from_address(address)
            view = self._logits_views[address, n_outputs] = np.frombuffer(rows, np.float32).reshape(n_outputs, n_vocab)
        return view

    def embedding(self, seq_id: int, n: int) -> np.ndarray:
        """The first n floats of a sequence's pooled output from the last decode (a copy)."""
        pointer = awaiting_backends(llama_cpp.llama_get_embeddings_seq, self.handle, seq_id)
        if not pointer:
            raise DecodeError(-1, f"no pooled output for sequence {seq_id}")
        return np.ctypeslib.as_array(pointer, shape=(n,)).copy()

    def token_embeddings(self, n_rows: int, n: int) -> np.ndarray:
        """Every output row of the last decode (no pooling: a vector per token), as (n_rows, n) (a copy)."""
        pointer = awaiting_backends(llama_cpp.llama_get_embeddings, self.handle)
        if not pointer:
            raise DecodeError(-1, "no token embeddings from the last decode")
        return np.ctypeslib.as_array(pointer, shape=(n_rows, n)).copy()

    def clear(self) -> None:
        """Free every KV cell (an embedding context starts each decode from nothing)."""
        if self._memory:  # encoder-only models keep no cache
            llama_cpp.llama_memory_clear(self._memory, True)

    # -- a sequence's memory: the primitives; engine.memory decides how to use them ----------

    def seq_rm(self, seq_id: int, from_pos: int = 0) -> bool:
        """Remove a sequence's positions >= from_pos (all by default). False when the memory
        refuses: recurrent state cannot lose a tail (beyond llama.cpp's rollback snapshots)."""
        return bool(llama_cpp.llama_memory_seq_rm(self._memory, seq_id, from_pos, -1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Give dst src's positions [p0, p1) (recurrent state: all of it, whatever the range)."""
        llama_cpp.llama_memory_seq_cp(self._memory, src, dst, p0, p1)

    def seq_pos_min(self, seq_id: int) -> int:
        """The sequence's smallest position in memory (-1: none)."""
        return llama_cpp.llama_memory_seq_pos_min(self._memory, seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """The sequence's largest position in memory (-1: none)."""
        return llama_cpp.llama_memory_seq_pos_max(self._memory, seq_id)

    def state(self, seq_id: int, partial: bool = False) -> bytes:
        """A copy of a sequence's memory; `partial`: only what a KV cache cannot recompute by
        cutting (recurrent state, sliding-window cells), llama.cpp's PARTIAL_ONLY."""
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
        size = llama_cpp.llama_state_seq_get_size_ext(self.handle, seq_id, flags)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data_ext(self.handle, buffer, size, seq_id, flags)
        return ctypes.string_at(buffer, written)  # one copy (slicing a ctypes array makes a list of ints)

    def set_state(self, seq_id: int, data: bytes, partial: bool = False) -> bool:
        """Put a copy made by state() back into seq_id (replacing what that part held); False when
        it does not fit."""
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return llama_cpp.llama_state_seq_set_data_ext(self.handle, buffer, len(data), seq_id, flags) == len(data)


class Batch(_Owner):
    """A llama_batch written through numpy views of its C arrays: a step fills every row with a
    few slice assignments. Each row's seq_id pointer is aimed at our own contiguous array (one
    sequence per row), so seq_ids are one slice too; llama_batch_init's own per-row arrays are
    put back before llama_batch_free frees them. With n_embd its rows are embeddings (an
    image's: native.projector.decode_images), not tokens, with n_pos_per_row positions each
    (M-RoPE's four: pos aims at our own array then, put back before the free as seq_id's are)."""

    kind = "batch"

    def __init__(self, capacity: int, n_embd: int = 0, n_pos_per_row: int = 1) -> None:
        struct = llama_cpp.llama_batch_init(capacity, n_embd, 1)
        super().__init__(struct)
        self.capacity = capacity
        self.n_pos_per_row = n_pos_per_row
        if n_embd:
            self.embd = np.ctypeslib.as_array(struct.embd, shape=(capacity, n_embd))
        else:
            self.token = np.ctypeslib.as_array(struct.token, shape=(capacity,))
        self._malloced_pos = ctypes.cast(struct.pos, ctypes.c_void_p).value  # an address: the field itself changes
        if n_pos_per_row == 1:
            self.pos = np.ctypeslib.as_array(struct.pos, shape=(capacity,))
        else:
            self.pos = np.zeros(capacity * n_pos_per_row, dtype=np.int32)
            struct.pos = self.pos.ctypes.data_as(type(struct.pos))
        self.logits = np.ctypeslib.as_array(struct.logits, shape=(capacity,))
        # The tokens again as a ctypes array, the positions as a pointer: set_next's writes (a list
        # of tokens, one row's position) cost about half as much through them as through numpy.
        self._tokens = (ctypes.c_int32 * capacity).from_address(self.token.ctypes.data) if not n_embd else None
        self._pos_at = struct.pos if not n_embd else None
        # The struct's pos field as a writable address (set_next aims it at a row of _ahead).
        self._pos_field = ctypes.c_void_p.from_buffer(struct, type(struct).pos.offset)
        self._own_pos = self._pos_field.value
        self._ahead: np.ndarray | None = None  # set_next's positions for the steps to come, a row a step
        self._ahead_rows: list[int] = []  # their addresses
        self._ahead_at = 0  # the row in use
        np.ctypeslib.as_array(struct.n_seq_id, shape=(capacity,))[:] = 1
        self.seq_id = np.zeros(capacity, dtype=np.int32)
        self._row_pointers = np.ctypeslib.as_array(ctypes.cast(struct.seq_id, ctypes.POINTER(ctypes.c_size_t)), shape=(capacity,))
        self._malloced = self._row_pointers.copy()
        self._row_pointers[:] = self.seq_id.ctypes.data + self.seq_id.itemsize * np.arange(capacity, dtype=np.uint64)
        self.n_tokens = 0
        self.n_outputs = 0

    def _free(self, struct) -> None:
        self._row_pointers[:] = self._malloced  # llama_batch_free frees what llama_batch_init allocated
        self._pos_field.value = self._malloced_pos
        llama_cpp.llama_batch_free(struct)

    @property
    def n_tokens(self) -> int:
        """Rows in use (the struct's own field: a plain step that repeats never writes it)."""
        return self.handle.n_tokens

    @n_tokens.setter
    def n_tokens(self, n: int) -> None:
        self.handle.n_tokens = n

    def set(self, tokens: list[int], pos: list[int], seq_ids: list[int], logits: list[int] | None = None) -> None:
        """Make the batch these rows: token, position, seq_id and logits flag (1 = keep its logits;
        None: every row keeps them)."""
        n = len(tokens)
        if n > self.capacity:
            raise ValueError(f"batch overflow: {n} tokens > capacity {self.capacity}")
        if self._ahead is not None:
            self._pos_field.value, self._ahead = self._own_pos, None
        if n == 1:  # one sequence decoding: scalar writes cost a quarter of slice writes
            self.token[0], self.pos[0], self.seq_id[0] = tokens[0], pos[0], seq_ids[0]
            self.logits[0] = 1 if logits is None else logits[0]
        else:
            self.token[:n] = tokens
            self.pos[:n] = pos
            self.seq_id[:n] = seq_ids
            self.logits[:n] = 1 if logits is None else logits
        self.n_tokens, self.n_outputs = n, n if logits is None else logits.count(1)

    def set_next(self, tokens: list[int]) -> None:
        """The same rows again, each with a new token at its next position (a plain step that
        repeats: seq_ids and logits flags stand). The positions of the next POSITIONS_AHEAD
        steps are written at once, a row each, and the batch's pos pointer moves one row a step:
        a numpy increment every step costs a tenth of the Python of a step of eight."""
        n = len(tokens)
        if n == 1:  # two item writes, cheaper than moving the pointer: one row keeps its own array
            self._tokens[0] = tokens[0]
            self._pos_at[0] += 1
            return
        self._tokens[:n] = tokens
        at = self._ahead_at + 1
        if self._ahead is None or at == POSITIONS_AHEAD:
            self._write_ahead(n)
            at = 0
        self._pos_field.value, self._ahead_at = self._ahead_rows[at], at

    def _write_ahead(self, n: int) -> None:
        """The next POSITIONS_AHEAD steps' positions of the n rows, after those in use."""
        last = self.pos[:n] if self._ahead is None else self._ahead[-1]
        self._ahead = last + _STEPS_AHEAD
        self._ahead_rows = list(range(self._ahead.ctypes.data, self._ahead.ctypes.data + self._ahead.nbytes, self._ahead.strides[0]))
