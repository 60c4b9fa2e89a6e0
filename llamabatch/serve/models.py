"""The models one server answers for: an engine worker each, loaded when asked for, unloaded when idle.

With one model (`serve` as it always was) the model loads at start and stays, unless it sleeps:
with --sleep-idle, a model with no work for that long is unloaded (its memory freed) and the next
request that needs it loads it again, while /health, /v1/models and /metrics answer without
waking it. With several (`serve --model A --model B`, `--models a,b`, `--models all`), a model
loads when the first request naming it comes (that request waits for the load; the other
models' requests go on) and unloads:
- when it has had no work for --sleep-idle seconds;
- to make room for another, past --max-loaded models or past the --memory the loaded models share
  (each planned as `llamabatch plan` plans it), least recently used first.
A model with work in flight (requests, sequences, embeddings, batches) is never unloaded; a
request holds a lease on its model from the moment it names it until its answer is sent. A load
that fails fails the requests waiting for it, with llama.cpp's reason, and leaves the model
unloaded: the next request tries again.

`POST /models/load` and `/models/unload` (llama-server's router routes) do the same on request,
and `/v1/models` lists every model with its state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..catalog import Catalog
from ..engine.config import EngineConfig
from ..engine.sizing.planning import plan_for
from ..errors import LlamabatchError, UnknownModel
from .worker import EngineWorker

POLL_S = 0.1  # how often a load that waits for room looks again


class ModelUnavailable(LlamabatchError):
    """A model that failed to load, or that has no room to load in: 503."""


class ModelBusy(LlamabatchError):
    """An unload asked for while the model has work in flight: 409."""


@dataclass(eq=False)
class Served:
    """One model the server answers for."""

    name: str
    settings: dict  # BatchEngine's keyword arguments
    worker: EngineWorker | None = None  # while loaded
    loading: asyncio.Future | None = None  # while loading: what every request for it waits on
    error: str | None = None  # why its last load failed
    planned_bytes: int | None = None  # what it takes loaded, planned once (with --memory only)
    leases: int = 0  # requests that named it and are not answered yet
    last_used: float = field(default_factory=time.monotonic)
    loads: int = 0
    load_seconds: float = 0.0  # its last load's
    asleep: bool = False  # unloaded for having been idle (--sleep-idle), until a request loads it again

    @property
    def state(self) -> str:
        worker = self.worker
        if worker is not None and worker.engine is not None:
            return "loaded"
        if self.loading is not None or (worker is not None and worker.load_error is None):
            return "loading"
        return "sleeping" if self.asleep else "unloaded"

    @property
    def busy(self) -> bool:
        return self.leases > 0 or (self.worker is not None and self.worker.busy)


class ModelPool:
    """Every served model by name; the first is the default (a request that names none)."""

    def __init__(
        self, models: dict[str, dict], make_worker: Callable[[Served], EngineWorker], *, max_loaded: int | None = None,
        memory: int | None = None, idle_unload: float | None = None,
    ) -> None:
        self.models = {name: Served(name, settings) for name, settings in models.items()}
        self.default = next(iter(self.models))
        self.make_worker = make_worker
        self.max_loaded, self.memory, self.idle_unload = max_loaded, memory, idle_unload
        self._idle_task: asyncio.Task | None = None
        self.stopping: str | None = None  # why requests are refused, once the server stops

    @property
    def several(self) -> bool:
        return len(self.models) > 1

    def workers(self) -> dict[str, EngineWorker]:
        """The loaded models' workers (read by the metrics when scraped)."""
        return {s.name: s.worker for s in list(self.models.values()) if s.worker is not None}

    # -- lifetime -----------------------------------------------------------------------

    def start(self) -> None:
        """One model: its worker starts loading it now, in its thread (the server says 503 until
        it has, or why it failed). Several: each loads when asked for, and idle ones unload."""
        if not self.several:
            served = self.models[self.default]
            served.worker = self.make_worker(served)
            served.worker.start()
        if self.idle_unload:
            self._idle_task = asyncio.ensure_future(self._unload_idle())

    def refuse(self, reason: str) -> None:
        """The server is stopping: every request from now on is refused with `reason` (503), on
        every model; what is in flight goes on."""
        self.stopping = reason
        for worker in self.workers().values():
            worker.refuse(reason)

    @property
    def requests_in_flight(self) -> bool:
        """Requests not answered yet (a stream counts until it ends); batches apart."""
        return any(s.leases or (s.worker is not None and s.worker.serving_requests) for s in self.models.values())

    def end_requests(self, reason: str) -> None:
        """End every request still open, on every model, with `reason` as its error."""
        for worker in self.workers().values():
            worker.end_requests(reason)

    async def stop(self, timeout: float | None = None) -> None:
        if self._idle_task is not None:
            self._idle_task.cancel()
        for served in self.models.values():
            if served.loading is not None:
                await asyncio.wait([served.loading])
        await asyncio.to_thread(self.close, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop every worker (each thread joined within `timeout` seconds), closing its engine
        (from any thread, no event loop needed)."""
        for served in self.models.values():
            worker, served.worker = served.worker, None
            if worker is not None:
                worker.stop(timeout)

    # -- requests -----------------------------------------------------------------------

    def resolve(self, name: str | None) -> Served:
        """The model a request names. One model answers every name (its engine refuses names it
        does not serve, adapters apart); with several, a name is a served model or an adapter of a
        loaded one, and no name is the default."""
        if not self.several or name is None:
            return self.models[self.default]
        if name in self.models:
            return self.models[name]
        for served in self.models.values():  # an adapter's name: its model's engine chooses it per request
            facts = served.worker.facts if served.worker is not None else None
            if facts is not None and any(a.name == name for a in facts.adapters):
                return served
        raise UnknownModel(f"model {name!r} is not served here; served: {', '.join(self.models)}")

    async def acquire(self, name: str | None) -> Served:
        """The named model, loaded, and held against unloading until release()."""
        if self.stopping is not None:
            raise ModelUnavailable(self.stopping)
        served = self.resolve(name)
        served.leases += 1
        try:
            await self.loaded(served)
        except BaseException:
            self.release(served)
            raise
        served.last_used = time.monotonic()
        return served

    def hold(self, served: Served) -> None:
        """One more hold on a model already held (a stream that outlives its request's handler;
        released when the response is over)."""
        served.leases += 1

    def release(self, served: Served) -> None:
        served.leases -= 1
        served.last_used = time.monotonic()

    async def loaded(self, served: Served) -> EngineWorker:
        """The model's worker, loading it first if need be (one load, however many wait)."""
        while served.worker is None:
            if served.loading is None:
                served.loading = asyncio.ensure_future(self._load(served))
                served.loading.add_done_callback(_observed)
            await asyncio.shield(served.loading)
        worker = served.worker
        if not worker.ready.is_set():  # the one model, loading since the start
            await asyncio.to_thread(worker.ready.wait)
        if worker.load_error is not None:
            raise ModelUnavailable(f"model {served.name} failed to load: {worker.load_error}")
        return worker

    async def unload(self, served: Served) -> None:
        """POST /models/unload: refused while it has work in flight."""
        if served.busy:
            raise ModelBusy(f"model {served.name} has requests in flight: it unloads when they are done")
        await self._unload(served)

    # -- loading and unloading ------------------------------------------------------------

    async def _load(self, served: Served) -> None:
        try:
            await self._make_room(served)
            started = time.perf_counter()
            worker = self.make_worker(served)
            worker.start()
            await asyncio.to_thread(worker.ready.wait)
            if worker.load_error is not None:
                error = worker.load_error
                await asyncio.to_thread(worker.stop)
                raise ModelUnavailable(f"model {served.name} failed to load: {error}")
            served.worker, served.error, served.asleep = worker, None, False
            served.loads += 1
            served.load_seconds = time.perf_counter() - started
            served.last_used = time.monotonic()
        except Exception as e:
            served.error = str(e)
            raise
        finally:
            served.loading = None

    async def _make_room(self, served: Served) -> None:
        """Unload the least recently used idle models until this one fits --max-loaded and
        --memory; wait while every model that would have to go has work in flight."""
        need = await self._planned(served)
        if self.memory is not None and need > self.memory:
            raise ModelUnavailable(f"model {served.name} needs {need / 2**30:.2f} GiB loaded, more than --memory {self.memory / 2**30:.2f} GiB")
        while True:
            held = [s for s in self.models.values() if s is not served and (s.worker is not None or s.loading is not None)]
            over = (self.max_loaded is not None and len(held) + 1 > self.max_loaded) or (
                self.memory is not None and sum(s.planned_bytes or 0 for s in held) + need > self.memory)
            if not over:
                return
            idle = [s for s in held if s.worker is not None and not s.busy]
            if idle:
                await self._unload(min(idle, key=lambda s: s.last_used))
            else:
                await asyncio.sleep(POLL_S)

    async def _planned(self, served: Served) -> int:
        """What the model takes loaded (only a --memory budget needs it): planned once."""
        if self.memory is None:
            return 0
        if served.planned_bytes is None:
            served.planned_bytes = await asyncio.to_thread(planned_bytes, served.settings)
        return served.planned_bytes

    async def _unload(self, served: Served) -> None:
        worker, served.worker = served.worker, None
        if worker is not None:
            await asyncio.to_thread(worker.stop)

    async def _unload_idle(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.idle_unload / 4))
            now = time.monotonic()
            for served in list(self.models.values()):
                if served.worker is None:
                    continue
                if served.busy:  # idle time counts from the end of its work
                    served.last_used = now
                elif now - served.last_used >= self.idle_unload:
                    await self._unload(served)
                    served.asleep = True


def planned_bytes(settings: dict) -> int:
    """The memory an engine of these settings takes, as `llamabatch plan` counts it (model,
    KV cache, buffers, checkpoints, the prompt cache's RAM tier), this process's own apart."""
    spec = Catalog.load(settings.get("catalog")).resolve(settings.get("model"))
    sizes = {k: settings.get(k) for k in ("n_parallel", "n_ctx", "n_ubatch", "kv_unified", "cache_type_k", "cache_type_v",
                                          "checkpoint_memory", "cache_ram")}
    config = EngineConfig.for_model(spec, **sizes)
    planned, _ = plan_for(
        settings.get("model"), catalog=settings.get("catalog"), ctx_per_seq=config.n_ctx // config.n_parallel, memory=1 << 60,
        kv_unified=config.kv_unified, n_ubatch=config.n_ubatch, max_parallel=config.n_parallel, cache_type_k=config.cache_type_k,
        cache_type_v=config.cache_type_v, checkpoint_memory=config.checkpoint_memory, cache_ram=config.cache_ram,
    )
    return planned.total_bytes - planned.process_bytes


def _observed(future: asyncio.Future) -> None:
    """A load nobody awaits any more still has its failure read (it is in the model's `error`)."""
    if not future.cancelled():
        future.exception()
