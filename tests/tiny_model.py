"""Write tiny GGUF models with random weights for fast tests: llama, the recurrent and hybrid
families (Mamba2, LFM2, Granite 4 hybrid, Qwen3.5), and a multimodal projector, whose tensor
names and shapes follow the vendored llama.cpp's src/llama-arch.cpp, src/models/*.cpp and
tools/mtmd/clip.cpp.

The vocabulary is SentencePiece-style with byte fallback: the 256 byte tokens
let any UTF-8 text round-trip, and a handful of word pieces make tokenization
non-trivial. Weights are random, so output is gibberish, but it is real
llama.cpp inference end to end.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter, Keys, PoolingType, TokenType

BOS, EOS, UNK = 1, 2, 0
WORD_PIECES = [
    "▁the", "▁a", "▁of", "▁is", "▁and", "▁to", "▁in", "▁capital", "▁France",
    "▁Paris", "▁def", "▁fib", "(n):", "▁Once", "▁upon", "▁time", "▁hello",
    "▁world", "▁", "e", "t", "a", "o", "n", "s", "r", "h", "l", "d", ".", ",",
]


def vocabulary(pieces: list[str] = WORD_PIECES) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)
    # Longer pieces score higher so the SPM tokenizer prefers them.
    scores = [0.0] * (3 + 256) + [float(len(p)) for p in pieces]
    return tokens, scores, [int(t) for t in types]


# Fill-in-the-middle tokens (Qwen2.5-Coder's texts), appended to the vocabulary by write_tiny_model(fim=True).
FIM_TOKENS = {Keys.Tokenizer.FIM_PRE_ID: "<|fim_prefix|>", Keys.Tokenizer.FIM_SUF_ID: "<|fim_suffix|>",
              Keys.Tokenizer.FIM_MID_ID: "<|fim_middle|>", Keys.Tokenizer.FIM_REP_ID: "<|repo_name|>",
              Keys.Tokenizer.FIM_SEP_ID: "<|file_sep|>"}


# The template every tiny model carries unless given another: ChatML, which llama.cpp also knows
# among its built-ins.
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"


def add_vocabulary(
    w: GGUFWriter, tokens: list[str], scores: list[float], types: list[int], chat_template: str | None = CHATML,
) -> None:
    """The SentencePiece-style tokenizer (BOS added, no EOS) and a chat template (None: none)."""
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_unk_token_id(UNK)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def write_tiny_model(
    path: Path,
    *,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_ff: int = 128,
    n_ctx_train: int = 2048,
    seed: int = 0,
    always_eos: bool = False,
    pieces: list[str] = WORD_PIECES,
    pooling: int | None = None,
    rank_head: bool = False,
    chat_template: str | None = CHATML,
    diffusion: bool = False,
    fim: bool = False,
    controls: tuple[str, ...] = (),
    mrope: str | None = None,
) -> Path:
    """Write a tiny F32 llama model (with `diffusion`, Dream's: the same tensors, attending both
    ways; with `mrope`, a Qwen-VL text model, "qwen2vl" (the same tensors) or "qwen3vl" (with
    per-head norms), rotated by M-RoPE's four sections (Qwen3-VL's interleaved), which positions
    past an image tell apart). `always_eos` makes EOS the greedy choice at every step;
    `pieces` are the word pieces after the byte tokens; `pooling` (a llama_pooling_type) is
    written as the model's embedding pooling. `rank_head` writes a reranker instead: the qwen3
    architecture (llama's, with per-head norms), rank pooling and a two-label classifier
    ("yes", "no"), as llama.cpp's Qwen3 rerankers are converted. `chat_template` is the Jinja
    template it carries (None: none). `fim` adds fill-in-the-middle tokens (FIM_TOKENS);
    `controls`, control tokens (llama.cpp renders them as nothing: a chat format's markers in many
    real vocabularies, such as Mistral's [TOOL_CALLS])."""
    tokens, scores, types = vocabulary(pieces)
    fim_ids = {}
    if fim:
        for key, text in FIM_TOKENS.items():
            fim_ids[key] = len(tokens)
            tokens.append(text)
            scores.append(0.0)
            types.append(int(TokenType.CONTROL))
    for text in controls:
        tokens.append(text)
        scores.append(0.0)
        types.append(int(TokenType.CONTROL))
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def weight(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    arch = "qwen3" if rank_head else "dream" if diffusion else mrope or "llama"
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-test-{arch}")
    if mrope:  # time, rows, columns, unused: a rotated head's n_embd / n_head / 2 pairs among them
        w.add_rope_dimension_sections([2, 3, 3, 0])
    if rank_head:
        pooling = 4  # rank
        w.add_classifier_output_labels(["yes", "no"])
    if pooling is not None:
        w.add_pooling_type(PoolingType(pooling))
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)  # all F32
    add_vocabulary(w, tokens, scores, types, chat_template)
    for key, token in fim_ids.items():
        w.add_uint32(key, token)

    embd = weight(n_vocab, n_embd, scale=1.0)
    output = weight(n_vocab, n_embd, scale=1.0)
    if always_eos:
        # A large constant component survives the (small) layers and RMS norm,
        # and only the EOS row reads it: EOS wins every argmax.
        embd[:, 0] += 20.0
        output[EOS, 0] = 50.0
    w.add_tensor("token_embd.weight", embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", weight(n_embd, n_embd))
        if rank_head or mrope == "qwen3vl":
            for name in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{i}.{name}.weight", np.ones(n_embd // n_head, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", weight(n_embd, n_ff))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", output)
    if rank_head:
        w.add_tensor("cls.output.weight", weight(2, n_embd, scale=1.0))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_lora(
    path: Path, *, n_embd: int = 64, n_layer: int = 2, n_ff: int = 128, rank: int = 4, alpha: float = 4.0,
    seed: int = 1, scale: float = 0.5, arch: str = "llama",
) -> Path:
    """Write a LoRA adapter for write_tiny_model's model (same sizes): random low-rank deltas on
    every attention and feed-forward matrix, strong enough to change greedy tokens."""
    shapes = {"attn_q": (n_embd, n_embd), "attn_k": (n_embd, n_embd), "attn_v": (n_embd, n_embd),
              "attn_output": (n_embd, n_embd), "ffn_gate": (n_ff, n_embd), "ffn_up": (n_ff, n_embd), "ffn_down": (n_embd, n_ff)}
    targets = [(f"blk.{i}.{name}.weight", n_out, n_in) for i in range(n_layer) for name, (n_out, n_in) in shapes.items()]
    return _write_lora(path, arch, targets, rank=rank, alpha=alpha, scale=scale, seed=seed)


LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_lora_for(model: Path, path: Path, *, rank: int = 8, scale: float = 0.05, seed: int = 1) -> Path:
    """Write a random LoRA adapter for any GGUF model (the default model too): low-rank deltas on
    its attention and feed-forward matrices, shaped from the model's own tensors."""
    from gguf import GGUFReader

    reader = GGUFReader(str(model))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    targets = []
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in LORA_TARGETS and parts[3] == "weight":
            targets.append((tensor.name, int(tensor.shape[1]), int(tensor.shape[0])))  # ggml's order: ne0 is the input
    return _write_lora(path, arch, targets, rank=rank, alpha=float(rank), scale=scale, seed=seed)


def _write_lora(path: Path, arch: str, targets: list[tuple[str, int, int]], *, rank: int, alpha: float, scale: float, seed: int) -> Path:
    """(weight name, outputs, inputs) each get `<weight>.lora_a` (rank x inputs) and `.lora_b`
    (outputs x rank), as llama.cpp's converter stores them: W' = W + s * alpha / rank * B @ A."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for name, n_out, n_in in targets:
        w.add_tensor(f"{name}.lora_a", (rng.standard_normal((rank, n_in)) * scale).astype(np.float32))
        w.add_tensor(f"{name}.lora_b", (rng.standard_normal((n_out, rank)) * scale).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_t5(path: Path, *, n_embd: int = 64, n_layer: int = 2, n_head: int = 4, n_ff: int = 128, seed: int = 0) -> Path:
    """Write a tiny T5 (an encoder and a decoder that attends to it), with write_tiny_model's
    vocabulary: a model that loads in llama.cpp but needs llama_encode before it decodes."""
    tokens, scores, types = vocabulary()
    rng = np.random.default_rng(seed)

    def weight(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    n_buckets = 32
    w = GGUFWriter(str(path), "t5")
    w.add_name("tiny-test-t5")
    w.add_context_length(512)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_relative_attn_buckets_count(n_buckets)
    w.add_file_type(0)
    add_vocabulary(w, tokens, scores, types, None)
    w.add_tensor("token_embd.weight", weight(len(tokens), n_embd, scale=1.0))
    for part, attentions in (("enc", ("attn",)), ("dec", ("attn", "cross_attn"))):
        for i in range(n_layer):
            b = f"{part}.blk.{i}"
            for a in attentions:
                w.add_tensor(f"{b}.{a}_norm.weight", np.ones(n_embd, np.float32))
                w.add_tensor(f"{b}.{a}_rel_b.weight", weight(n_buckets, n_head))
                for name in ("q", "k", "v", "o"):
                    w.add_tensor(f"{b}.{a}_{name}.weight", weight(n_embd, n_embd))
            w.add_tensor(f"{b}.ffn_norm.weight", np.ones(n_embd, np.float32))
            w.add_tensor(f"{b}.ffn_up.weight", weight(n_ff, n_embd))
            w.add_tensor(f"{b}.ffn_down.weight", weight(n_embd, n_ff))
        w.add_tensor(f"{part}.output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", weight(len(tokens), n_embd, scale=1.0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# The recurrent and hybrid families, by llama.cpp architecture name: one recurrent, three hybrids
# (LFM2 short convolutions, Granite 4's Mamba2 layers, Qwen3.5's gated delta-net, each beside
# attention). LFM2 and Qwen3.5 keep llama.cpp's rollback snapshots; Mamba2 and Granite do not.
FAMILIES = ("mamba2", "lfm2", "granitehybrid", "qwen35")


def write_tiny_family(
    path: Path, arch: str, *, n_embd: int = 64, n_layer: int = 4, n_head: int = 4, n_ff: int = 128, seed: int = 0,
    perturb: float = 0.0, d_state: int = 16, n_ssm_head: int = 4, attention_every: int = 2, extra_pieces: int = 0,
    f16: bool = False,
) -> Path:
    """Write a tiny model of a recurrent or hybrid architecture (FAMILIES), with write_tiny_model's
    vocabulary. Hybrids attend in every attention_every-th layer (the odd ones by default); the
    others are recurrent. `perturb` adds that much noise to the output layer: a near copy of the
    seed's model, which agrees with it often but not always (a draft model whose drafts are partly
    accepted). The benchmarks write models of real models' shapes with the rest: the recurrent
    state's size (d_state, n_ssm_head), `extra_pieces` more vocabulary, F16 matrices."""
    if arch not in FAMILIES:
        raise ValueError(f"not a family these tests write: {arch}")
    tokens, scores, types = vocabulary(WORD_PIECES + [f"▁piece{i}" for i in range(extra_pieces)])
    rng = np.random.default_rng(seed)
    matrix_type = np.float16 if f16 else np.float32

    def weight(*shape: int, scale: float = 0.1) -> np.ndarray:
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        return values.astype(matrix_type) if len(shape) > 1 else values

    head = n_embd // n_head
    attends = [arch != "mamba2" and i % attention_every == attention_every - 1 for i in range(n_layer)]
    n_group, d_conv = 1, 4
    d_inner = d_state * n_ssm_head if arch == "qwen35" else 2 * n_embd  # delta-net: a d_state square per value head
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-test-{arch}")
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    if arch in ("mamba2", "qwen35"):  # Qwen3.5's loader reads one count for all its attention layers
        w.add_head_count_kv(0 if arch == "mamba2" else n_head)
    else:  # a count per layer: 0 marks a recurrent one
        w.add_head_count_kv([n_head if a else 0 for a in attends])
    w.add_rope_dimension_count(head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1 if f16 else 0)
    add_vocabulary(w, tokens, scores, types)
    if arch == "lfm2":
        w.add_uint32("lfm2.shortconv.l_cache", 3)
    else:
        w.add_ssm_conv_kernel(d_conv)
        w.add_ssm_inner_size(d_inner)
        w.add_ssm_state_size(d_state)
        w.add_ssm_time_step_rank(n_ssm_head)
        w.add_ssm_group_count(n_group)
    if arch == "qwen35":
        w.add_rope_dimension_sections([head // 4, head // 4, 0, 0])
        w.add_uint32("qwen35.full_attention_interval", attention_every)

    w.add_tensor("token_embd.weight", weight(len(tokens), n_embd, scale=1.0))
    for i in range(n_layer):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", np.ones(n_embd, np.float32))
        if attends[i]:
            w.add_tensor(f"{b}.attn_q.weight", weight(n_embd * (2 if arch == "qwen35" else 1), n_embd))  # Qwen3.5: and a gate
            for name in ("attn_k", "attn_v", "attn_output"):
                w.add_tensor(f"{b}.{name}.weight", weight(n_embd, n_embd))
            if arch in ("lfm2", "qwen35"):
                w.add_tensor(f"{b}.attn_q_norm.weight", np.ones(head, np.float32))
                w.add_tensor(f"{b}.attn_k_norm.weight", np.ones(head, np.float32))
        elif arch == "lfm2":
            w.add_tensor(f"{b}.shortconv.conv.weight", weight(n_embd, 3).astype(np.float32))  # the conv stays F32
            w.add_tensor(f"{b}.shortconv.in_proj.weight", weight(3 * n_embd, n_embd))
            w.add_tensor(f"{b}.shortconv.out_proj.weight", weight(n_embd, n_embd))
        elif arch == "qwen35":
            key_dim, value_dim = d_state * n_group, d_state * n_ssm_head
            conv_dim = 2 * key_dim + value_dim
            w.add_tensor(f"{b}.attn_qkv.weight", weight(conv_dim, n_embd))
            w.add_tensor(f"{b}.attn_gate.weight", weight(value_dim, n_embd))
            w.add_tensor(f"{b}.ssm_conv1d.weight", weight(conv_dim, d_conv, scale=0.5).astype(np.float32))
            w.add_tensor(f"{b}.ssm_dt.bias", weight(n_ssm_head))
            w.add_tensor(f"{b}.ssm_a", -np.ones(n_ssm_head, np.float32))  # A = -exp(A_log), as converted
            w.add_tensor(f"{b}.ssm_beta.weight", weight(n_ssm_head, n_embd))
            w.add_tensor(f"{b}.ssm_alpha.weight", weight(n_ssm_head, n_embd))
            w.add_tensor(f"{b}.ssm_norm.weight", np.ones(d_state, np.float32))
            w.add_tensor(f"{b}.ssm_out.weight", weight(n_embd, value_dim))
        else:  # Mamba2 layers (mamba2, granitehybrid)
            conv_dim = d_inner + 2 * n_group * d_state
            in_proj = d_inner + conv_dim + n_ssm_head  # z, then x B C, then dt
            w.add_tensor(f"{b}.ssm_in.weight", weight(in_proj, n_embd))
            w.add_tensor(f"{b}.ssm_conv1d.weight", weight(conv_dim, d_conv, scale=0.5).astype(np.float32))
            w.add_tensor(f"{b}.ssm_conv1d.bias", weight(conv_dim))
            w.add_tensor(f"{b}.ssm_dt.bias", weight(n_ssm_head))
            w.add_tensor(f"{b}.ssm_a", -np.ones((n_ssm_head, 1), np.float32))
            w.add_tensor(f"{b}.ssm_d", np.ones((n_ssm_head, 1), np.float32))
            w.add_tensor(f"{b}.ssm_norm.weight", np.ones((n_group, d_inner // n_group), np.float32))
            w.add_tensor(f"{b}.ssm_out.weight", weight(n_embd, d_inner))
        if arch == "mamba2":
            continue  # no feed-forward: the Mamba block is the layer
        w.add_tensor(f"{b}.{'post_attention_norm' if arch == 'qwen35' else 'ffn_norm'}.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"{b}.ffn_gate.weight", weight(n_ff, n_embd))
        w.add_tensor(f"{b}.ffn_up.weight", weight(n_ff, n_embd))
        w.add_tensor(f"{b}.ffn_down.weight", weight(n_embd, n_ff))
    # LFM2's GGUFs name the final norm token_embd_norm (llama.cpp keeps the converter's name)
    w.add_tensor("token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight", np.ones(n_embd, np.float32))
    output = weight(len(tokens), n_embd, scale=1.0)
    if perturb:
        output = output + (perturb * np.random.default_rng(seed + 1).standard_normal(output.shape)).astype(output.dtype)
    w.add_tensor("output.weight", output)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_projector(
    path: Path, *, kind: str = "mlp", n_embd_text: int = 64, n_embd: int = 32, n_layer: int = 2, n_head: int = 4,
    n_ff: int = 64, image_size: int = 28, patch_size: int = 14, seed: int = 0,
) -> Path:
    """Write a tiny multimodal projector (an mmproj GGUF) as llama.cpp's tools/mtmd/clip.cpp loads
    it, of `kind`:
    - "mlp", LLaVA's: a ViT, then two linear layers into the text model's n_embd_text; an image
      is resized to image_size² and fills (image_size / patch_size)² positions;
    - "qwen2vl_merger", Qwen2-VL's: two patch convolutions added, a ViT rotated by M-RoPE, each
      2×2 of patches merged into one row by two linear layers; an image is resized to a grid of
      28-pixel cells, a row each, which the text model reads at M-RoPE positions (time, row,
      column), max(rows, columns) of them (image_size: the largest side it reads)."""
    if kind not in ("mlp", "qwen2vl_merger"):
        raise ValueError(f"not a projector these tests write: {kind}")
    rng = np.random.default_rng(seed)

    def weight(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = GGUFWriter(str(path), "clip")
    w.add_name(f"tiny-test-{kind}-projector")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", kind)
    w.add_bool("clip.use_gelu", True)
    for key, value in (("image_size", image_size), ("patch_size", patch_size), ("embedding_length", n_embd),
                       ("feed_forward_length", n_ff), ("block_count", n_layer), ("projection_dim", n_embd_text),
                       ("attention.head_count", n_head)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_file_type(0)  # all F32
    w.add_tensor("v.patch_embd.weight", weight(n_embd, 3, patch_size, patch_size))
    if kind == "mlp":
        w.add_tensor("v.position_embd.weight", weight((image_size // patch_size) ** 2, n_embd))
    else:
        w.add_tensor("v.patch_embd.weight.1", weight(n_embd, 3, patch_size, patch_size))  # the second frame's
    _vit_blocks(w, "v", weight, n_layer, n_embd, n_ff)
    # The projection into the text model's embeddings, at the scale of its token embeddings: from
    # each patch's features (LLaVA's), or from 2×2 patches' (Qwen2-VL's merger, after a final norm).
    n_in = n_embd
    if kind == "qwen2vl_merger":
        w.add_tensor("v.post_ln.weight", np.ones(n_embd, np.float32))
        w.add_tensor("v.post_ln.bias", np.zeros(n_embd, np.float32))
        n_in = 4 * n_embd
    n_hidden = n_in if kind == "qwen2vl_merger" else n_embd_text
    w.add_tensor("mm.0.weight", weight(n_hidden, n_in, scale=0.5 if kind == "qwen2vl_merger" else 1.0))
    w.add_tensor("mm.0.bias", np.zeros(n_hidden, np.float32))
    w.add_tensor("mm.2.weight", weight(n_embd_text, n_hidden, scale=1.0))
    w.add_tensor("mm.2.bias", np.zeros(n_embd_text, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_audio_projector(
    path: Path, *, n_embd_text: int = 64, n_embd: int = 32, n_layer: int = 2, n_head: int = 4, n_ff: int = 64,
    n_mel: int = 16, seed: int = 0,
) -> Path:
    """Write a tiny audio projector (an mmproj GGUF) of Qwen2-Audio's kind, as llama.cpp's
    tools/mtmd/clip.cpp loads it ("qwen2a": Whisper's encoder, two 1-D convolutions, the second
    of stride 2, then a ViT and an average pool of 2; one linear layer into the text model's
    n_embd_text): a clip is read in 30-second pieces of 3000 mel frames, 750 positions each."""
    rng = np.random.default_rng(seed)

    def weight(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = GGUFWriter(str(path), "clip")
    w.add_name("tiny-test-audio-projector")
    w.add_bool("clip.has_audio_encoder", True)
    w.add_string("clip.projector_type", "qwen2a")
    for key, value in (("embedding_length", n_embd), ("feed_forward_length", n_ff), ("block_count", n_layer),
                       ("projection_dim", n_embd_text), ("attention.head_count", n_head), ("num_mel_bins", n_mel)):
        w.add_uint32(f"clip.audio.{key}", value)
    w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
    w.add_file_type(0)  # all F32
    # Convolutions as ggml lays them out (kernel width, in, out); a bias per output channel.
    w.add_tensor("a.conv1d.1.weight", weight(n_embd, n_mel, 3))
    w.add_tensor("a.conv1d.1.bias", np.zeros((n_embd, 1), np.float32))
    w.add_tensor("a.conv1d.2.weight", weight(n_embd, n_embd, 3))
    w.add_tensor("a.conv1d.2.bias", np.zeros((n_embd, 1), np.float32))
    w.add_tensor("a.position_embd.weight", weight(1500, n_embd))  # a 30-second piece's positions after the stride
    _vit_blocks(w, "a", weight, n_layer, n_embd, n_ff, key_bias=False)  # Whisper's keys have no bias
    w.add_tensor("mm.a.fc.weight", weight(n_embd_text, n_embd, scale=1.0))
    w.add_tensor("mm.a.fc.bias", np.zeros(n_embd_text, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _vit_blocks(w: GGUFWriter, prefix: str, weight, n_layer: int, n_embd: int, n_ff: int, key_bias: bool = True) -> None:
    """A projector's encoder blocks as clip.cpp names them ("v.blk.N" for images, "a.blk.N" for
    audio): attention with biases, two layer norms, a two-layer FFN with biases."""
    for i in range(n_layer):
        b = f"{prefix}.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"{b}.{name}.weight", weight(n_embd, n_embd))
            if key_bias or name != "attn_k":
                w.add_tensor(f"{b}.{name}.bias", np.zeros(n_embd, np.float32))
        for norm in ("ln1", "ln2"):
            w.add_tensor(f"{b}.{norm}.weight", np.ones(n_embd, np.float32))
            w.add_tensor(f"{b}.{norm}.bias", np.zeros(n_embd, np.float32))
        w.add_tensor(f"{b}.ffn_up.weight", weight(n_ff, n_embd))
        w.add_tensor(f"{b}.ffn_up.bias", np.zeros(n_ff, np.float32))
        w.add_tensor(f"{b}.ffn_down.weight", weight(n_embd, n_ff))
        w.add_tensor(f"{b}.ffn_down.bias", np.zeros(n_embd, np.float32))


def wav(samples: np.ndarray, rate: int = 16_000) -> bytes:
    """A mono 16-bit WAV file of samples in [-1, 1]."""
    import io
    import wave

    out = io.BytesIO()
    with wave.open(out, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes((np.clip(samples, -1, 1) * 32767).astype(np.int16).tobytes())
    return out.getvalue()


if __name__ == "__main__":  # python tests/tiny_model.py tiny.gguf: the model the docs' examples name
    import sys

    print(write_tiny_model(Path(sys.argv[1])))


def real_templates_folder() -> Path:
    """llama.cpp's collection of models' chat templates (models/templates of the vendored
    sources), which scripts/build_native.sh keeps beside the native tools."""
    import os

    import llama_cpp

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(os.environ.get("LLAMABATCH_NATIVE_DIR") or cache / "llamabatch" / "native" / llama_cpp.__version__) / "templates"


def real_template(name: str) -> str:
    """A model's own chat template from llama.cpp's collection, by file name without .jinja."""
    return (real_templates_folder() / f"{name}.jinja").read_text()


def real_templates_kept() -> bool:
    try:
        real_template("Qwen-Qwen2.5-7B-Instruct")
    except OSError:
        return False
    return True
