"""The engine options a command was given, turned into BatchEngine's keyword arguments in one
place, so every command spells and means them the same way: --ctx is the KV cache in all,
--ctx-per-seq one sequence's share, --parallel N or auto, --memory only with --parallel auto."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
import sys
from pathlib import Path

from ...catalog import Catalog
from ...errors import ConfigError
from ..config import EngineConfig
from ..config import size_option, parse_duration, parse_size
from . import tuning
from ..batch_engine import BatchEngine
from .planning import plan_for

AUTO = "auto"
# The options the command line names otherwise than EngineConfig does; the rest share its names.
RENAMED = {"threads": "n_threads", "scheduling_policy": "scheduling"}
CONFIG_FIELDS = {f.name for f in fields(EngineConfig)} - {"n_parallel", "n_ctx"}  # the slots and cache size: planned apart


@dataclass(frozen=True)
class EngineOptions:
    """Named as the command line names them; None: the catalog's (or the engine's) default."""

    model: str | Path | None = None
    config: Path | None = None  # the catalog file (models.toml)
    parallel: str | int | None = None  # slots, or "auto": as many as fit --memory
    ctx: int | None = None  # KV cells in all, shared by the slots
    ctx_per_seq: int | None = None  # KV cells per sequence: --ctx is this times the slots
    memory: str | None = None  # the budget --parallel auto plans for (default: what is free now)
    n_batch: int | None = None  # --batch-size: most tokens a llama_decode takes (not sequences)
    n_ubatch: int | None = None  # --ubatch-size
    threads: int | None = None
    gpu_layers: int | None = None
    kv_unified: bool | None = None
    share_prefixes: bool | None = None
    deterministic: bool | None = None
    speculative: str | None = None
    draft_model: str | None = None
    draft_max: int | None = None
    checkpoint_every: int | None = None
    checkpoint_memory: str | None = None  # a size: 512MiB, 1GiB, 0
    embed_pack: int | None = None
    cache_ram: str | None = None  # a size: 4GiB, 0
    cache_dir: Path | None = None
    cache_disk: str | None = None  # a size
    scheduling_policy: str | None = None
    lora: list[str] | None = None  # PATH[:SCALE] or a catalog adapter's NAME[:SCALE], each
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    flash_attn: str | None = None
    rpc: str | None = None  # HOST:PORT[,HOST:PORT...]
    tensor_split: str | None = None  # N0,N1,...
    rpc_timeout: float | None = None
    chat: bool | None = None
    chat_template: str | None = None  # a Jinja file, or a llama.cpp built-in's name
    mmproj: str | None = None  # the multimodal projector GGUF
    mmproj_offload: bool | None = None
    max_itl: str | None = None  # a duration (150ms): --parallel auto keeps p95 inter-token latency within it
    step_target: str | None = None  # a duration, auto or off; default: --max-itl when given
    overlap: str | None = None  # auto, on or off
    verbose: bool = False

    @classmethod
    def of(cls, params: Mapping[str, object]) -> EngineOptions:
        """The engine options among a command's parameters (Typer's context.params), by name."""
        return cls(**{f.name: params[f.name] for f in fields(cls) if f.name in params})

    @property
    def auto(self) -> bool:
        return self.parallel == AUTO

    def engine_kwargs(self, n_sequences: int | None = None) -> dict:
        """BatchEngine's keyword arguments. With --parallel auto the slots are planned here: the
        measured batch size (`llamabatch tune`, measured first when this machine has no
        measurement for this model and these settings), never more than fit --memory with
        --ctx-per-seq cells each, nor more than n_sequences (when known)."""
        self._check()
        n_parallel, n_ctx = self._plan(n_sequences) if self.auto else self._slots()
        return dict(self._settings(), n_parallel=n_parallel, n_ctx=n_ctx)

    def engine_kwargs_for(self, n_parallel: int) -> dict:
        """BatchEngine's keyword arguments for an engine of n_parallel slots of the catalog's context each."""
        return dict(self._settings(), n_parallel=n_parallel)

    def _settings(self) -> dict:
        """BatchEngine's keyword arguments but the slots and the cache size: every option that is
        an EngineConfig field, under the config's name."""
        settings = {RENAMED.get(f.name, f.name): getattr(self, f.name) for f in fields(self)}
        if self.step_target is None and self.max_itl is not None:  # a step is a stream's gap: keep it within the latency asked for
            settings["step_target"] = self.max_itl
        return dict({k: v for k, v in settings.items() if k in CONFIG_FIELDS}, model=self.model, catalog=self.config)

    def tuning(self, max_batch: int | None = None, say=None, again: bool = False,
               prompt_tokens: int = tuning.PROMPT_TOKENS, progress=None) -> tuning.Tuning:
        """The stored batch-size measurement for this model and these settings on this machine,
        or (when there is none, or `again`) a new one of up to max_batch slots, stored for next
        time. `say` hears why it measures, `progress` how far it is (tuning.tune's)."""
        found = None if again else self.stored_tuning()
        if found is not None:
            return found
        spec = Catalog.load(self.config).resolve(self.model)
        if say and not again:
            say(f"no batch size measured for {spec.name} with these settings on this machine: measuring it (llamabatch tune)")
        n = min(max_batch or tuning.MAX_BATCH, tuning.MAX_BATCH)
        with BatchEngine(**self._settings(), n_parallel=n, n_ctx=n * tuning.cells_per_sequence(prompt_tokens)) as engine:
            measured = tuning.tune(engine, spec.gguf_path(), n, prompt_tokens=prompt_tokens, progress=progress)
        tuning.save(measured)
        return measured

    def stored_tuning(self) -> tuning.Tuning | None:
        """The measurement `tuning()` would take, if one is stored; nothing is measured."""
        spec = Catalog.load(self.config).resolve(self.model)
        overrides = {k: v for k, v in self._settings().items() if k not in ("model", "catalog")}
        config = EngineConfig.for_model(spec, **{**overrides, "n_parallel": 1, "n_ctx": 256})
        return tuning.load(tuning.settings_of(config, spec.gguf_path()))

    @property
    def max_itl_s(self) -> float | None:
        try:
            return None if self.max_itl is None else parse_duration(self.max_itl)
        except ValueError as e:
            raise ConfigError(f"--max-itl: {e}") from None

    def _check(self) -> None:
        """Options that this combination would ignore, or read two ways, are errors."""
        if self.max_itl is not None and not self.auto:
            raise ConfigError("--max-itl is the latency --parallel auto chooses for: add --parallel auto, or drop --max-itl")
        _ = self.max_itl_s  # a bad duration is refused before anything loads
        if self.memory is not None and not self.auto:
            raise ConfigError("--memory is the budget --parallel auto plans for: add --parallel auto, or drop --memory")
        if self.ctx is not None and self.ctx_per_seq is not None:
            raise ConfigError("give --ctx (KV cells in all) or --ctx-per-seq (each sequence's), not both")
        if self.ctx is not None and self.auto:
            raise ConfigError("--parallel auto sizes the whole cache: give each sequence's context with --ctx-per-seq, not --ctx")
        if self.parallel is not None and not self.auto:
            try:
                if int(self.parallel) < 1:
                    raise ValueError
            except ValueError:
                raise ConfigError(f"--parallel must be a number >= 1 or 'auto', got {self.parallel!r}") from None

    def _slots(self) -> tuple[int | None, int | None]:
        n_parallel = None if self.parallel is None else int(self.parallel)
        if self.ctx_per_seq is None:
            return n_parallel, self.ctx
        slots = n_parallel or Catalog.load(self.config).resolve(self.model).parallel
        return n_parallel, slots * self.ctx_per_seq

    def memory_plan(self, n_sequences: int | None = None, ctx_per_seq: int | None = None):
        """The most slots of ctx_per_seq cells (default: --ctx-per-seq, else the catalog's) that
        fit --memory, never more than n_sequences (planning.plan_for)."""
        kv_unified = EngineConfig.kv_unified if self.kv_unified is None else self.kv_unified
        planned, _ = plan_for(
            self.model, catalog=self.config, ctx_per_seq=ctx_per_seq or self.ctx_per_seq, memory=memory_budget(self.memory),
            kv_unified=kv_unified, n_ubatch=self.n_ubatch, max_parallel=n_sequences, cache_type_k=self.cache_type_k,
            cache_type_v=self.cache_type_v, rpc=self.rpc, verbose=self.verbose,
            checkpoint_memory=None if self.checkpoint_memory is None else size_option(self.checkpoint_memory, "--checkpoint-memory"),
            cache_ram=0 if self.cache_ram is None else size_option(self.cache_ram, "--cache-ram"),
        )
        return planned

    def _plan(self, n_sequences: int | None) -> tuple[int, int]:
        planned = self.memory_plan(n_sequences)
        # the measured choice, cut to what fits and to the sequences there are (up to its size,
        # more rows a step were measured to pay)
        chosen = self.tuning(planned.n_parallel, say=_say).choose(self.max_itl_s).batch_size
        n_parallel = min(chosen, planned.n_parallel)
        return n_parallel, planned.n_ctx // planned.n_parallel * n_parallel


def _say(text: str) -> None:
    print(text, file=sys.stderr)


def memory_budget(text: str | None) -> int | None:
    """--memory in bytes (None: not given)."""
    try:
        return None if text is None else parse_size(text)
    except ValueError as e:
        raise ConfigError(f"--memory: {e}") from None
