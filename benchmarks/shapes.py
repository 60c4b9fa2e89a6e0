"""Models of real shapes with random weights, quantized as llama.cpp stores them: the arithmetic of a
decode depends on the shapes and the quantization, not on the values, so these decode at a real
model's speed without carrying its gigabytes (a GPU machine reached with 64 MiB of files writes
its own). Llama's architecture with each model's sizes (head width, grouped KV heads, vocabulary),
every matrix Q4_K where its rows allow (a multiple of 256 wide) and Q8_0 elsewhere, written as
random blocks whose scales keep the activations finite."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType

Q4_K, Q8_0 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0


@dataclass(frozen=True)
class Shape:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int


SHAPES = {
    # Gemma 3 270M's sizes (the default model); its sliding window and norms aside
    "gemma3-270m": Shape(n_vocab=262_144, n_embd=640, n_layer=18, n_head=4, n_head_kv=1, head_dim=256, n_ff=2048),
    "llama3.1-8b": Shape(n_vocab=128_256, n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, head_dim=128, n_ff=14_336),
    "small": Shape(n_vocab=4096, n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_ff=512),  # a rehearsal's
}


def write_shape(path: Path, shape: Shape, seed: int = 0) -> Path:
    """A llama-architecture GGUF of `shape` with random quantized weights, F32 norms, and a
    byte-fallback SentencePiece vocabulary padded to n_vocab tokens."""
    rng = np.random.default_rng(seed)
    s = shape
    w = GGUFWriter(str(path), "llama")
    w.add_name(f"random-{path.stem}")
    w.add_context_length(131_072)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    _vocabulary(w, s.n_vocab)
    _add(w, rng, "token_embd.weight", s.n_vocab, s.n_embd)
    for i in range(s.n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(s.n_embd, np.float32))
        _add(w, rng, f"blk.{i}.attn_q.weight", s.n_head * s.head_dim, s.n_embd)
        _add(w, rng, f"blk.{i}.attn_k.weight", s.n_head_kv * s.head_dim, s.n_embd)
        _add(w, rng, f"blk.{i}.attn_v.weight", s.n_head_kv * s.head_dim, s.n_embd)
        _add(w, rng, f"blk.{i}.attn_output.weight", s.n_embd, s.n_head * s.head_dim)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(s.n_embd, np.float32))
        _add(w, rng, f"blk.{i}.ffn_gate.weight", s.n_ff, s.n_embd)
        _add(w, rng, f"blk.{i}.ffn_up.weight", s.n_ff, s.n_embd)
        _add(w, rng, f"blk.{i}.ffn_down.weight", s.n_embd, s.n_ff)
    w.add_tensor("output_norm.weight", np.ones(s.n_embd, np.float32))
    _add(w, rng, "output.weight", s.n_vocab, s.n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add(w: GGUFWriter, rng: np.random.Generator, name: str, rows: int, columns: int) -> None:
    """A rows x columns matrix as random quantized blocks (Q4_K where a row is whole 256-blocks,
    else Q8_0), each block's scale small: weights within about ±0.1."""
    kind = Q4_K if columns % 256 == 0 else Q8_0
    per_block, block_bytes = (256, 144) if kind == Q4_K else (32, 34)
    blocks = rng.integers(0, 256, size=(rows * columns // per_block, block_bytes), dtype=np.uint8)
    scale = np.array([1e-4 if kind == Q4_K else 1e-3], dtype=np.float16).view(np.uint8)
    blocks[:, 0:2] = scale  # d (Q4_K: and dmin, next)
    if kind == Q4_K:
        blocks[:, 2:4] = scale
    w.add_tensor(name, blocks.reshape(rows, columns // per_block * block_bytes), raw_dtype=kind)


def _vocabulary(w: GGUFWriter, n_vocab: int) -> None:
    """<unk>, <s>, </s>, the 256 byte tokens, then filler pieces up to n_vocab (text tokenizes
    through the bytes; the vocabulary's size is what a decode's output layer costs)."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256]
    tokens += [f"<w{i}>" for i in range(n_vocab - len(tokens))]
    types += [TokenType.NORMAL] * (n_vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
