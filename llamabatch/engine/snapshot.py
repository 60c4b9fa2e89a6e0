"""What other threads may know of an engine: its facts, fixed from load to close, and a snapshot
of its state that the engine thread publishes between steps. Both are immutable values, so a
reader (metrics, /health, /v1/models, the server's worker, a web page) never touches a sequence,
the scheduler or memory in flight, and a model closing under a reader leaves it a valid value."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from .adapters import AdapterInfo, AdapterSet

if TYPE_CHECKING:
    from .memory.streams import Memory
    from .memory.prompt_cache import PromptCache, TierStats
    from .results import RunStats
    from .scheduling.scheduler import Scheduler

CLASSES = ("interactive", "batch")  # priority classes, by entry point (Sequence.priority_class)


@dataclass(frozen=True)
class EngineFacts:
    """A loaded engine's settings as llama.cpp resolved them."""

    model: str
    n_parallel: int
    n_ctx: int
    n_ctx_seq: int  # one sequence's context
    n_vocab: int
    cache_type_k: str
    cache_type_v: str
    flash_attn: str  # "on" or "off" once llama.cpp decided
    memory_family: str  # attention, sliding-window, recurrent or hybrid
    checkpoint_memory: int  # bytes checkpoints may hold (0: the memory needs none)
    memory_bytes: int  # weights and KV
    adapters: tuple[AdapterInfo, ...] = ()
    default_adapters: AdapterSet = ()
    rpc: tuple[str, ...] = ()


@dataclass(frozen=True)
class CacheTier:
    hits: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0
    budget: int = 0


@dataclass(frozen=True)
class PromptCacheFigures:
    ram: CacheTier
    disk: CacheTier
    misses: int
    kept: int
    refused: int


_NONE: Mapping[str, int] = MappingProxyType({name: 0 for name in CLASSES})


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine between two steps. Counters run from the engine's start (or its last
    reset_stats); the rest is its state then."""

    version: int = 0  # the scheduler's count of joins and leaves when it was taken
    waiting: Mapping[str, int] = field(default_factory=lambda: _NONE)  # sequences waiting for a slot, by class
    running: Mapping[str, int] = field(default_factory=lambda: _NONE)  # holding a slot, by class
    kv_cells: int = 0  # positions the running sequences hold in memory
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    checkpoint_restores: int = 0
    completion_tokens: int = 0
    decode_calls: int = 0
    draft_tokens: int = 0
    draft_accepted: int = 0
    priority_preemptions: int = 0
    adapter_switches: int = 0
    prompt_cache: PromptCacheFigures | None = None
    broken: str | None = None

    @property
    def has_work(self) -> bool:
        return any(self.waiting.values()) or any(self.running.values())

    @property
    def tokens_per_decode(self) -> float:
        return self.completion_tokens / self.decode_calls if self.decode_calls else 0.0


IDLE = EngineSnapshot()  # an engine not loaded, or not stepped yet


def take(scheduler: Scheduler, memory: Memory, stats: RunStats, cache: PromptCache | None, broken: str | None) -> EngineSnapshot:
    """The engine's state now (on the engine thread: it reads the running sequences)."""
    running = Counter(seq.priority_class for seq in scheduler.running)
    return EngineSnapshot(
        version=scheduler.version,
        waiting=MappingProxyType({name: scheduler.waiting.count(name) for name in CLASSES}),
        running=MappingProxyType({name: running[name] for name in CLASSES}),
        kv_cells=sum(seq.n_past for seq in scheduler.running),
        checkpoints=memory.checkpoints.count,
        checkpoint_bytes=memory.checkpoints.bytes,
        checkpoint_restores=memory.restored,
        completion_tokens=stats.completion_tokens,
        decode_calls=stats.decode_calls,
        draft_tokens=stats.draft_tokens,
        draft_accepted=stats.draft_accepted,
        priority_preemptions=stats.priority_preemptions,
        adapter_switches=stats.adapter_switches,
        prompt_cache=None if cache is None else PromptCacheFigures(
            _tier(cache.stats.ram, cache.ram_bytes), _tier(cache.stats.disk, cache.disk_bytes),
            cache.stats.misses, cache.stats.kept, cache.stats.refused,
        ),
        broken=broken,
    )


def _tier(tier: TierStats, budget: int) -> CacheTier:
    return CacheTier(tier.hits, tier.evictions, tier.entries, tier.bytes, budget)
