"""Loading and ownership: the llama.cpp side of one engine, made in order and freed in reverse."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from ..catalog import ModelSpec
from ..chat import ChatTemplate
from ..chat.conversation import Chat
from ..errors import ChatTemplateError, ConfigError, ModelError
from .adapters import Adapters
from .config import CHECKPOINT_EVERY, RPC_TIMEOUT_S, WINDOW_CHECKPOINT_EVERY, EngineConfig
from .embedding import MAX_TEXTS_PER_DECODE, Embedder, Pooling, model_pooling
from .memory.streams import Family, Memory
from .native.handles import Batch, Context, Model
from .native.projector import Projector
from .native.backend import init_backend, use_row_invariant_matmul
from .memory.prompt_cache import PromptCache, fingerprint
from .rpc import guard as rpc_guard, local_accelerators, remote_devices
from .speculative.speculator import Speculator
from .sampling.truncation import Scratch


class Runtime:
    """The model, its adapters, the context and its memory, the batch, the chat format, the
    speculator (and a draft model), the prompt cache and the embedding contexts of one engine.
    It is their one owner: close() frees them all, in reverse order of loading."""

    def __init__(self, spec: ModelSpec, config: EngineConfig, draft_path: Path | None) -> None:
        self.config = cfg = config
        path = spec.gguf_path()
        init_backend(cfg.verbose)
        if cfg.deterministic:  # kernels that do not change with the number of rows (docs/guides/deterministic.md)
            use_row_invariant_matmul()
        # Deterministic mode needs a second KV stream even for one slot: fillers decode there.
        self.n_streams = max(cfg.n_parallel, 2) if cfg.deterministic else cfg.n_parallel
        with ExitStack() as undo:  # a handle that fails to load frees those made before it
            self.model = Model(path, cfg.gpu_layers, repack=not cfg.deterministic, **self._placement())
            undo.callback(self.model.close)
            self.model.check_supported()
            self.adapters = Adapters(self.model, spec.adapters, cfg.lora)
            undo.callback(self.adapters.close)
            self.ctx = Context(
                self.model, n_ctx=cfg.n_ctx * self.n_streams // cfg.n_parallel, n_batch=cfg.n_batch, n_ubatch=cfg.n_ubatch,
                n_seq_max=self.n_streams, n_threads=cfg.n_threads, kv_unified=cfg.kv_unified,
                cache_type_k=cfg.cache_type_k, cache_type_v=cfg.cache_type_v, flash_attn=cfg.flash_attn,
                n_rs_seq=self._rollback_snapshots(),
            )
            undo.callback(self.ctx.close)
            # Without shared prefixes a finished sequence's memory is freed: no prefix outlives it
            # to be checkpointed (transient checkpoints, for drafts and fillers, need no budget).
            self.memory = Memory(self.ctx, self.model, cfg.checkpoint_memory if cfg.share_prefixes else 0)
            self.chat = self._chat(spec.chat_template)  # a --chat-template refused frees what was loaded
            self.speculator = Speculator.for_config(cfg, self.model.vocab, self.ctx.n_ctx, draft_path)
            if self.speculator is not None:
                undo.callback(self.speculator.close)
            self.prompt_cache = self._prompt_cache(path)
            if self.prompt_cache is not None:
                undo.callback(self.prompt_cache.close)
            self.batch = Batch(self.ctx.n_batch)
            undo.callback(self.batch.close)
            self.projector, self.media_batch = self._projector()
            for handle in (self.projector, self.media_batch):
                if handle is not None:
                    undo.callback(handle.close)
            undo.pop_all()  # loaded: close() frees them from now on
        self.vocab = self.model.vocab
        self.scratch = Scratch(self.vocab.n_vocab)  # buffers sampled rows reuse
        self._embedders: dict[Pooling, Embedder] = {}  # made on first use, one per pooling type
        self._default_pooling: Pooling | None = None

    @property
    def checkpoint_every(self) -> int | None:
        """Prompt tokens between checkpoints (0: at prompt ends and parting points only; None:
        none, the memory can be cut anywhere): --checkpoint-every, else the family's. A sliding
        window's checkpoint holds the whole window, so windows are checkpointed further apart."""
        if not self.memory.checkpointing:
            return None
        if self.config.checkpoint_every is not None:
            return self.config.checkpoint_every
        if self.memory.caps.family is Family.SLIDING_WINDOW:
            return max(WINDOW_CHECKPOINT_EVERY, self.memory.caps.n_swa // 2)
        return CHECKPOINT_EVERY

    def _prompt_cache(self, path: Path) -> PromptCache | None:
        cfg = self.config
        if not cfg.cache_ram and not cfg.cache_dir:
            return None
        key = fingerprint(path, [spec.path for spec, _ in self.adapters.chosen], cfg.cache_type_k, cfg.cache_type_v, str(self.ctx.flash_attn),
                          None if cfg.mmproj is None else Path(cfg.mmproj))
        return PromptCache(cfg.cache_ram, key, None if cfg.cache_dir is None else Path(cfg.cache_dir), cfg.cache_disk)

    def _projector(self) -> tuple[Projector | None, Batch | None]:
        """The multimodal projector (--mmproj), and the batch images are decoded from."""
        cfg = self.config
        if cfg.mmproj is None:
            return None, None
        projector = Projector(Path(cfg.mmproj), self.model, cfg.n_threads, offload=cfg.mmproj_offload)
        try:
            if projector.mrope and self.memory.caps.family is not Family.ATTENTION:
                # Its images fill fewer positions than cells; checkpoints and windows count positions as cells.
                raise ModelError(f"this model places images with M-RoPE (Qwen-VL's grid of positions), which llamabatch "
                                 f"reads only into attention memory, not {self.memory.caps.family.value} memory")
            return projector, Batch(self.ctx.n_batch, projector.n_embd, n_pos_per_row=4 if projector.mrope else 1)
        except BaseException:
            projector.close()
            raise

    def _chat(self, builtin: str | None) -> Chat | None:
        """The model's chat format: --chat-template over the GGUF's template over the catalog's
        built-in (for GGUFs without one); None when there is no template at all. A template the
        user named that cannot be read, parsed or found is refused here, not on every request."""
        vocab, override = self.model.vocab, self.config.chat_template
        try:
            template = ChatTemplate.choose(override, self.model.chat_template_text(), builtin,
                                           bos=vocab.text(vocab.bos) or "", eos=vocab.text(vocab.eos) or "")
            if template is None:
                return None
            chat = Chat(template, vocab, lambda messages: self.model.apply_builtin_template(messages, template.source))
            if override is not None:
                chat.check()
        except (ChatTemplateError, ModelError) as e:
            raise ConfigError(f"--chat-template {override}: {e}" if override else str(e)) from None
        return chat

    def _rollback_snapshots(self) -> int:
        """Speculation on recurrent or hybrid memory: ask llama.cpp to keep the states after each of
        a decode's last draft_max tokens, so rejected drafts roll back without a checkpoint (where
        the architecture supports it; elsewhere llama.cpp grants none and checkpoints do it)."""
        cfg = self.config
        if cfg.speculative == "off" or not (self.model.is_recurrent or self.model.is_hybrid):
            return 0
        return cfg.draft_max

    def _placement(self) -> dict:
        """Where the model's offloaded layers go: with --rpc, the remotes' devices, then this
        host's GPUs (llama.cpp's order), each taking its --tensor-split share."""
        cfg = self.config
        if not cfg.rpc:
            return dict(tensor_split=cfg.tensor_split)
        devices = remote_devices(cfg.rpc) + local_accelerators()
        rpc_guard.exit_when_lost(cfg.rpc, cfg.rpc_timeout or RPC_TIMEOUT_S)  # from here, a remote gone is an exit, not an abort or a hang
        return dict(devices=devices, tensor_split=cfg.tensor_split)

    def embedder(self, pooling: str | Pooling | None = None) -> Embedder:
        """The embedding context for `pooling` (by default the GGUF's, else mean), made on first
        use beside the generation context, on the same weights."""
        if pooling is None:  # read from the GGUF once: a job asks for every line
            pooling = self._default_pooling = self._default_pooling or model_pooling(self.model) or Pooling.MEAN
        chosen = Pooling(pooling)
        embedder = self._embedders.get(chosen)
        if embedder is None:
            cfg = self.config
            # Deterministic: each text decoded alone, so its vector does not depend on the others.
            embedder = self._embedders[chosen] = Embedder(
                self.model, chosen, n_threads=cfg.n_threads, pack_tokens=cfg.embed_pack,
                max_texts=1 if cfg.deterministic else MAX_TEXTS_PER_DECODE,
            )
            self.adapters.attach(embedder.ctx, self.adapters.default)  # the vectors of the model generation uses
        return embedder

    def close(self) -> None:
        """Free every handle: prompt cache (its writer finishes), speculator, embedding contexts,
        projector, batches, context, adapters, then the model."""
        if self.prompt_cache is not None:
            self.prompt_cache.close()
        if self.speculator is not None:
            self.speculator.close()
        for embedder in self._embedders.values():
            embedder.close()
        for handle in (self.media_batch, self.projector):
            if handle is not None:
                handle.close()
        self.batch.close()
        self.ctx.close()
        self.adapters.close()  # before the model, which would free them itself
        self.model.close()
        if self.config.rpc:
            rpc_guard.exit_when_lost((), 0)
