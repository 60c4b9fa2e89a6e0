"""The server's Prometheus metrics, fed by the engine worker's hooks (prometheus_client)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..engine.snapshot import CLASSES  # a label on the metrics that differ by entry point
from .models import Served
from .worker import EngineWorker, Observer, StepReport

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True)
class RequestCounters:
    """One model's request counters, for the code that answers its requests."""

    finished: object
    failed: object


class Metrics:
    """Every series is labelled by the model it describes (a server may hold several)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, workers: Callable[[], dict[str, EngineWorker]]) -> None:
        self.registry = r = CollectorRegistry()
        m = ["model"]
        self.running = Gauge("llamabatch_sequences_running", "Sequences holding a slot", [*m, "class"], registry=r)
        self.queued = Gauge("llamabatch_sequences_queued", "Sequences waiting for a slot", [*m, "class"], registry=r)
        self.batches = Gauge("llamabatch_batches_in_progress", "Batch API batches being run", m, registry=r)
        self.loaded = Gauge("llamabatch_model_loaded", "1 while the model is loaded, 0 while it sleeps, loads or is unloaded", m, registry=r)
        self.kv_cells = Gauge("llamabatch_kv_cells_used", "KV cells held by running sequences", m, registry=r)
        self.finished = Counter("llamabatch_requests_finished", "Requests answered in full", m, registry=r)
        self.failed = Counter("llamabatch_requests_failed", "Requests refused, cancelled or timed out", m, registry=r)
        self.prompt_tokens = Counter("llamabatch_prompt_tokens", "Prompt tokens of finished sequences", m, registry=r)
        self.cached_tokens = Counter(
            "llamabatch_prompt_tokens_cached", "Prompt tokens of finished sequences taken from a cache, not decoded", m, registry=r,
        )
        # Recurrent, hybrid and sliding-window models: the state checkpoints that let a prefix be reused.
        self.checkpoint_bytes = Gauge("llamabatch_checkpoint_bytes", "Host memory held by state checkpoints", m, registry=r)
        self.checkpoints = Gauge("llamabatch_checkpoints", "State checkpoints kept", m, registry=r)
        self.generated_tokens = Counter("llamabatch_generated_tokens", "Tokens sampled", [*m, "class"], registry=r)
        self.tokens_per_decode = Gauge("llamabatch_tokens_per_decode", "Tokens sampled per llama_decode call", m, registry=r)
        self.active = Histogram(
            "llamabatch_active_sequences_per_decode", "Sequences in each llama_decode call", m,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r,
        )
        self.step_seconds = Histogram("llamabatch_step_seconds", "Time per engine step", m, buckets=_LATENCY_BUCKETS, registry=r)
        self.step_prompt_tokens = Histogram(
            "llamabatch_step_prompt_tokens", "Prompt tokens each engine step decoded (the step budget's share beside decoders)", m,
            buckets=(0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), registry=r,
        )
        self.ttft = Histogram(
            "llamabatch_time_to_first_token_seconds", "Submission to first token", [*m, "class"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = StepHistogram("llamabatch_inter_token_latency_seconds", "Between a sequence's tokens", _LATENCY_BUCKETS, r)
        self.registry.register(_EngineCounters(workers))
        self.registry.register(_EngineInfo(workers))
        self.registry.register(_PromptCacheMetrics(workers))

    def watch(self, model: str, worker: EngineWorker) -> None:
        """The model's gauges read the snapshot its worker's engine published last, when scraped
        (a model loaded again brings a new worker; one unloaded reads as idle)."""
        for name in CLASSES:  # each class's series exists from the start, at 0
            self.running.labels(model, name).set_function(lambda name=name: worker.snapshot.running[name])
            self.generated_tokens.labels(model, name)
            self.ttft.labels(model, name)
        self.queued.labels(model, "interactive").set_function(lambda: worker.queued)  # with requests not yet taken
        self.queued.labels(model, "batch").set_function(lambda: worker.snapshot.waiting["batch"])
        self.batches.labels(model).set_function(lambda: worker.n_batches)
        gauges = {
            self.kv_cells: "kv_cells", self.checkpoint_bytes: "checkpoint_bytes", self.checkpoints: "checkpoints",
            self.tokens_per_decode: "tokens_per_decode",
        }
        for gauge, field in gauges.items():
            gauge.labels(model).set_function(lambda field=field: getattr(worker.snapshot, field))
        self.finished.labels(model)
        self.failed.labels(model)

    def watch_states(self, served: Iterable[Served]) -> None:
        for model in served:
            self.loaded.labels(model.name).set_function(lambda model=model: model.state == "loaded")

    def of(self, model: str) -> RequestCounters:
        return RequestCounters(self.finished.labels(model), self.failed.labels(model))

    def observer(self, model: str) -> Observer:
        return Observer(on_step=lambda report: self._on_step(model, report))

    def _on_step(self, model: str, report: StepReport) -> None:
        """Once a step, from the engine's thread: what its tokens add up to."""
        if report.n_sequences:
            self.active.labels(model).observe(report.n_sequences)
            self.step_seconds.labels(model).observe(report.seconds)
            self.step_prompt_tokens.labels(model).observe(report.prompt_tokens)
        for name, n in report.tokens.items():
            self.generated_tokens.labels(model, name).inc(n)
        for name, seconds in report.first_tokens:
            self.ttft.labels(model, name).observe(seconds)
        self.itl.observe_many(model, report.gaps)
        for result in report.finished:
            self.prompt_tokens.labels(model).inc(result.prompt_tokens)
            self.cached_tokens.labels(model).inc(result.cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StepHistogram(Collector):
    """A Prometheus histogram, labelled by model, fed a step's values at once: every token of a
    step adds an inter-token gap, and one bucket count over them all costs less than an observe() each."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self._bounds = np.array(buckets, dtype=np.float64)
        self._counts: dict[str, np.ndarray] = {}  # per model; the last bucket: above every bound (+Inf)
        self._sums: dict[str, float] = {}
        self._lock = threading.Lock()  # scrapes read from another thread
        registry.register(self)

    def observe_many(self, model: str, values: list[float]) -> None:
        if not values:
            return
        counts = np.bincount(np.searchsorted(self._bounds, values), minlength=len(self._bounds) + 1)  # value <= bound: that bucket
        with self._lock:
            self._counts[model] = self._counts.get(model, 0) + counts
            self._sums[model] = self._sums.get(model, 0.0) + float(np.sum(values))

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model"])
        with self._lock:
            taken = {model: (np.cumsum(counts).tolist(), self._sums[model]) for model, counts in self._counts.items()}
        for model, (cumulative, total) in taken.items():
            buckets = [(floatToGoString(b), c) for b, c in zip(self._bounds.tolist(), cumulative)] + [("+Inf", cumulative[-1])]
            family.add_metric([model], buckets, total)
        yield family


class _EngineCounters(Collector):
    """Each loaded engine's running totals, read from its snapshot when scraped, as counters (so
    rate() and increase() read them right): drafts verified and kept, priority preemptions, adapter
    switches, checkpoints put back."""

    COUNTERS = (
        ("llamabatch_draft_tokens", "Speculative tokens verified", "draft_tokens"),
        ("llamabatch_draft_tokens_accepted", "Speculative tokens the model agreed with", "draft_accepted"),
        ("llamabatch_priority_preemptions", "Sequences preempted for a better priority", "priority_preemptions"),
        ("llamabatch_adapter_switches", "Steps that changed the LoRA adapter set", "adapter_switches"),
        ("llamabatch_checkpoint_restores", "Sequences put back to a checkpoint (a reused prefix, rejected drafts)", "checkpoint_restores"),
    )

    def __init__(self, workers: Callable[[], dict[str, EngineWorker]]) -> None:
        self.workers = workers

    def collect(self):
        snapshots = {model: worker.snapshot for model, worker in self.workers().items()}
        for name, documentation, field in self.COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=["model"])
            for model, snapshot in snapshots.items():
                family.add_metric([model], getattr(snapshot, field))
            yield family


class _EngineInfo(Collector):
    """llamabatch_engine_info: what each loaded engine runs with (model, KV cache types, flash
    attention as llama.cpp resolved it, adapters)."""

    def __init__(self, workers: Callable[[], dict[str, EngineWorker]]) -> None:
        self.workers = workers

    def collect(self):
        family = InfoMetricFamily("llamabatch_engine", "Each loaded engine's settings", labels=["model"])
        for model, worker in self.workers().items():
            facts = worker.facts
            if facts is None:
                continue
            family.add_metric([model], {
                "cache_type_k": facts.cache_type_k, "cache_type_v": facts.cache_type_v, "flash_attn": facts.flash_attn,
                "parallel": str(facts.n_parallel), "adapters": ",".join(a.name for a in facts.adapters),
                "rpc": ",".join(facts.rpc), "memory": facts.memory_family, "checkpoint_memory": str(facts.checkpoint_memory),
            })
        yield family


class _PromptCacheMetrics(Collector):
    """Each loaded engine's prompt cache (from its snapshot), labelled by model and tier."""

    def __init__(self, workers: Callable[[], dict[str, EngineWorker]]) -> None:
        self.workers = workers

    def collect(self):
        caches = {model: w.snapshot.prompt_cache for model, w in self.workers().items() if w.snapshot.prompt_cache is not None}
        tiers = ("ram", "disk")
        for name, doc, kind in (
            ("hits", "Prompts whose prefix was restored from the tier", CounterMetricFamily),
            ("evictions", "Entries pushed out of the tier for room", CounterMetricFamily),
            ("entries", "Prompts the tier holds", GaugeMetricFamily),
            ("bytes", "Bytes the tier holds", GaugeMetricFamily),
        ):
            family = kind(f"llamabatch_prompt_cache_{name}", doc, labels=["model", "tier"])
            for model, cache in caches.items():
                for tier in tiers:
                    family.add_metric([model, tier], getattr(getattr(cache, tier), name))
            yield family
        for name, doc in (
            ("misses", "Admitted prompts no entry gave more than their slot"),
            ("kept", "Prompts kept as their slot was taken"),
            ("refused", "Entries removed as unreadable, foreign or refused"),
        ):
            family = CounterMetricFamily(f"llamabatch_prompt_cache_{name}", doc, labels=["model"])
            for model, cache in caches.items():
                family.add_metric([model], getattr(cache, name))
            yield family
        budget = GaugeMetricFamily("llamabatch_prompt_cache_budget_bytes", "Each tier's budget in bytes", labels=["model", "tier"])
        for model, cache in caches.items():
            for tier in tiers:
                budget.add_metric([model, tier], getattr(cache, tier).budget)
        yield budget
