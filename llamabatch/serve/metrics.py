"""The server's Prometheus metrics, fed by the engine worker's hooks (prometheus_client)."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import InfoMetricFamily
from prometheus_client.registry import Collector

from ..engine import Sequence
from .worker import EngineWorker, Observer

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Priority classes, a label on the metrics that differ by entry point: interactive requests, and
# the Batch API's batches (which run below them).
CLASSES = ("interactive", "batch")


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge("llamabatch_sequences_running", "Sequences holding a slot", ["class"], registry=r)
        self.queued = Gauge("llamabatch_sequences_queued", "Sequences waiting for a slot", ["class"], registry=r)
        self.batches = Gauge("llamabatch_batches_in_progress", "Batch API batches being run", registry=r)
        self.kv_cells = Gauge("llamabatch_kv_cells_used", "KV cells held by running sequences", registry=r)
        self.finished = Counter("llamabatch_requests_finished", "Requests answered in full", registry=r)
        self.failed = Counter("llamabatch_requests_failed", "Requests refused, cancelled or timed out", registry=r)
        self.prompt_tokens = Counter("llamabatch_prompt_tokens", "Prompt tokens of finished sequences", registry=r)
        self.cached_tokens = Counter(
            "llamabatch_prompt_tokens_cached", "Prompt tokens of finished sequences taken from a cache, not decoded", registry=r,
        )
        # Recurrent and hybrid models: the state checkpoints that let a prefix be reused (engine.memory).
        self.checkpoint_bytes = Gauge("llamabatch_checkpoint_bytes", "Host memory held by state checkpoints", registry=r)
        self.checkpoints = Gauge("llamabatch_checkpoints", "State checkpoints kept", registry=r)
        self.checkpoint_restores = Gauge(
            "llamabatch_checkpoint_restores", "Sequences put back to a checkpoint (a reused prefix, rejected drafts)", registry=r,
        )
        self.generated_tokens = Counter("llamabatch_generated_tokens", "Tokens sampled", ["class"], registry=r)
        # Speculative decoding, read from the engine's counters when scraped.
        self.drafted = Gauge("llamabatch_draft_tokens", "Speculative tokens verified", registry=r)
        self.accepted = Gauge("llamabatch_draft_tokens_accepted", "Speculative tokens the model agreed with", registry=r)
        self.tokens_per_decode = Gauge("llamabatch_tokens_per_decode", "Tokens sampled per llama_decode call", registry=r)
        self.active = Histogram(
            "llamabatch_active_sequences_per_decode", "Sequences in each llama_decode call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r,
        )
        self.step_seconds = Histogram("llamabatch_step_seconds", "Time per engine step", buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(
            "llamabatch_time_to_first_token_seconds", "Submission to first token", ["class"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.preempted = Gauge("llamabatch_priority_preemptions", "Sequences preempted for a better priority", registry=r)
        self.itl = Histogram("llamabatch_inter_token_latency_seconds", "Between a sequence's tokens", buckets=_LATENCY_BUCKETS, registry=r)
        self.adapter_switches = Gauge("llamabatch_adapter_switches", "Steps that changed the LoRA adapter set", registry=r)

    def watch(self, worker: EngineWorker) -> None:
        """Gauges read the worker's state when scraped."""
        for name in CLASSES:  # each class's series exists from the start, at 0
            self.running.labels(name).set_function(lambda name=name: worker.running_in(name))
            self.generated_tokens.labels(name)
            self.ttft.labels(name)
        self.queued.labels("interactive").set_function(lambda: worker.queued)  # with requests not yet taken
        self.queued.labels("batch").set_function(lambda: worker.waiting("batch"))
        self.batches.set_function(lambda: worker.n_batches)
        self.kv_cells.set_function(lambda: sum(s.n_past for s in worker.engine.scheduler.running) if worker.engine else 0)
        stats = lambda: worker.engine.stats if worker.engine else None  # noqa: E731
        self.drafted.set_function(lambda: stats().draft_tokens if stats() else 0)
        self.preempted.set_function(lambda: stats().priority_preemptions if stats() else 0)
        self.accepted.set_function(lambda: stats().draft_accepted if stats() else 0)
        self.adapter_switches.set_function(lambda: stats().adapter_switches if stats() else 0)
        memory = lambda: worker.engine.memory if worker.engine else None  # noqa: E731
        self.checkpoint_bytes.set_function(lambda: memory().checkpoints.bytes if memory() else 0)
        self.checkpoints.set_function(lambda: memory().checkpoints.count if memory() else 0)
        self.checkpoint_restores.set_function(lambda: memory().restored if memory() else 0)
        self.registry.register(_EngineInfo(worker))
        self.tokens_per_decode.set_function(
            lambda: stats().completion_tokens / stats().decode_calls if stats() and stats().decode_calls else 0
        )

    def observer(self) -> Observer:
        return Observer(on_step=self._on_step, on_token=self._on_token, on_finish=self._on_finish)

    def _on_step(self, n_sequences: int, seconds: float) -> None:
        if n_sequences:
            self.active.observe(n_sequences)
            self.step_seconds.observe(seconds)

    def _on_token(self, seq: Sequence, since_last: float | None) -> None:
        self.generated_tokens.labels(seq.priority_class).inc()
        if since_last is None:
            self.ttft.labels(seq.priority_class).observe(time.perf_counter() - seq.t_submitted)
        else:
            self.itl.observe(since_last)

    def _on_finish(self, seq: Sequence) -> None:
        self.prompt_tokens.inc(seq.n_prompt)
        self.cached_tokens.inc(seq.n_cached)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineInfo(Collector):
    """llamabatch_engine_info: what the loaded engine runs with (model, KV cache types, flash
    attention as llama.cpp resolved it, adapters), once it has loaded."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker

    def collect(self):
        engine = self.worker.engine
        if engine is None:
            return
        k, v = engine.ctx.cache_types
        yield InfoMetricFamily("llamabatch_engine", "The loaded engine's settings", value={
            "model": engine.model_name, "cache_type_k": k, "cache_type_v": v, "flash_attn": engine.ctx.flash_attn,
            "parallel": str(engine.config.n_parallel), "adapters": ",".join(a.name for a in engine.adapters.info),
            "rpc": ",".join(engine.config.rpc), "memory": engine.memory.caps.family.value,
            "checkpoint_memory": str(engine.config.checkpoint_memory if not engine.memory.caps.can_cut else 0),
        })
