"""Batch jobs on a Ray cluster. Ray Data reads the job file (`JobLines`: lines not answered yet,
in blocks), a pool of `BatchPredictor` actors generates (each loads the model once and runs
every batch of rows it is given through its own BatchEngine, continuous batching inside), and
the driver writes the output lines exactly as `llamabatch batch` does, so resuming, the
manifest and the error file work the same. Ray restarts a dead actor and retries its rows; the
driver writes each id once.

Ray is an optional dependency (`pip install "llamabatch[ray]"`): it is imported here only.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from ray.data import Datasource, ReadTask
from ray.data.block import BlockMetadata

from ..catalog import Catalog
from ..engine import BatchEngine, EngineConfig, SamplingParams
from ..engine.adapters import chosen_adapters
from ..errors import LlamabatchError
from .batch_job import Job, JobSummary, Stopped
from .inputs import STDIN, BadLine, Format, JobLine, LineParser, numbered_lines, peek_id
from .ledger import IdSet, digest
from .manifest import job_settings
from .runner import IDLE, Outcome, RequestRunner

BLOCK_ROWS = 256  # lines per block read from the job file
ROWS_PER_SLOT = 8  # rows per batch: each batch's lines are written when its last row is done
BATCHES_IN_FLIGHT = 2  # per actor: the next batch's rows join the engine while one finishes


class JobLines(Datasource):
    """The job file's lines, as (line number, text) rows, without those whose id is in `done`.
    One read task streams the file in blocks; it runs on the driver's node, which has the file."""

    def __init__(self, path: Path, fmt: Format, done: IdSet) -> None:
        super().__init__()
        self.path, self.format, self.done = path, fmt, done

    def estimate_inmemory_data_size(self) -> int:
        return self.path.stat().st_size

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None) -> list[ReadTask]:
        path, fmt, done = self.path, self.format, self.done

        def read() -> Iterator[pa.Table]:
            lines: list[int] = []
            texts: list[str | None] = []
            for n, text in numbered_lines(path):
                if peek_id(fmt, n, text) in done:
                    continue
                lines.append(n)
                texts.append(text)
                if len(lines) == BLOCK_ROWS:
                    yield pa.table({"line": lines, "text": texts})
                    lines, texts = [], []
            if lines:
                yield pa.table({"line": lines, "text": texts})

        metadata = BlockMetadata(num_rows=None, size_bytes=self.estimate_inmemory_data_size(), input_files=[str(path)], exec_stats=None)
        return [ReadTask(read, metadata, per_task_row_limit=per_task_row_limit)]


class BatchPredictor:
    """A Ray Data stage: `dataset.map_batches(BatchPredictor, fn_constructor_kwargs={...},
    compute=ActorPoolStrategy(size=N, max_tasks_in_flight_per_actor=2, max_concurrent_calls_per_actor=2),
    num_cpus=threads, batch_size=...)`. Rows are job-file lines (`line`, `text`: an OpenAI batch
    line, a llamabatch JSON line or a prompt); they come back as rows (`id`, `ok`, `record`: the
    JSON line `llamabatch batch` writes to the output, or to the error file when not ok, and
    token counts).

    All batches an actor holds feed one engine. Ray Data runs an actor's calls one at a time
    (above), so a batch's requests join the engine once the call before has returned; the lock
    and the answers kept between calls hold whichever way Ray runs them.
    """

    def __init__(self, format: str, engine: dict, base: dict | None = None, incomplete_errors: bool = False,
                 folder: str | None = None) -> None:
        self.engine = BatchEngine(**engine)
        # `folder`: the job file's, absolute, where a line's relative image and audio paths start
        self.parser = LineParser(Format(format), SamplingParams(**base) if base else SamplingParams(), folder=Path(folder) if folder else None)
        self._pending: deque[JobLine | BadLine] = deque()  # parsed, not yet handed to the engine
        self._answered: dict[str, Outcome] = {}  # finished, not yet taken by their batch
        self._driving = threading.Lock()
        runner = RequestRunner(self.engine, self.parser.format, incomplete_errors=incomplete_errors)
        self._outcomes = runner.run(self._feed())

    def _feed(self) -> Iterator[JobLine | BadLine | object]:
        while True:
            yield self._pending.popleft() if self._pending else IDLE

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        requests = [self.parser.parse(int(n), text) for n, text in zip(batch["line"], batch["text"])]
        self._pending.extend(requests)
        mine = [r.id for r in requests]
        while True:
            with self._driving:  # another call may have answered ours while this one waited
                if all(id_ in self._answered for id_ in mine):
                    break
                outcome = next(self._outcomes)
                self._answered[outcome.id] = outcome
        return _rows([self._answered.pop(id_) for id_ in mine])

    def __del__(self) -> None:
        # Ray Data's teardown hook for a stage: it deletes the UDF when the actor shuts down.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def _rows(outcomes: list[Outcome]) -> dict[str, list]:
    return {"id": [o.id for o in outcomes], "ok": [o.ok for o in outcomes],
            "record": [json.dumps(o.record, ensure_ascii=False) for o in outcomes],
            "prompt_tokens": [o.prompt_tokens for o in outcomes], "completion_tokens": [o.completion_tokens for o in outcomes],
            "incomplete": [o.incomplete for o in outcomes]}


class RayBatchJob(Job):
    """`llamabatch batch --ray`: the same job, its requests answered by `replicas` actors."""

    def __init__(
        self,
        engine: dict,
        input: str | Path,
        output: str | Path,
        *,
        address: str | None = None,
        replicas: int | str = 1,
        threads: int | None = None,
        errors: str | Path | None = None,
        base: SamplingParams | None = None,
        retry_errors: bool = False,
        overwrite: bool = False,
        incomplete_errors: bool = False,
        on_progress: Callable[[JobSummary], None] | None = None,
    ) -> None:
        if str(input) == STDIN:
            raise LlamabatchError("--ray reads the job from a file (its read task runs in a Ray worker, not on this terminal)")
        super().__init__(input, output, errors=errors, base=base, retry_errors=retry_errors, overwrite=overwrite,
                         on_progress=on_progress)
        self.reader.close()  # the read task opens the file itself
        spec = Catalog.load(engine.get("catalog")).resolve(engine.get("model"))
        # The driver checks the model and settings before the cluster loads them: the actors' engines' config.
        config = EngineConfig.for_model(spec, **{k: v for k, v in engine.items() if k not in ("model", "catalog")})
        self.settings = job_settings(spec.name, spec.gguf_path(), config, self.format, self.base,
                                     adapters=chosen_adapters(spec.adapters, config.lora))
        self.parallel = config.n_parallel
        self.engine_options = engine
        self.incomplete_errors = incomplete_errors
        self.address = address
        self.replicas = replicas
        self.threads = threads

    def run(self) -> JobSummary:
        started = time.perf_counter()
        try:
            done = self.prepare()
            self.summary.skipped = sum(peek_id(self.format, n, text) in done for n, text in numbered_lines(self.input)) if len(done) else 0
            written: set[bytes] = set()  # a retried batch must not write its ids twice
            for outcome in self._outcomes(done):
                key = digest(outcome.id)
                if key not in written:
                    written.add(key)
                    self.record(outcome)
                if self.stop_signals:  # what is written stays; a resumed run does the rest
                    break
        except Stopped:
            pass
        finally:
            self._out.close()
            self._err.close()
            self.summary.stopped_by = self.stop_signals[0] if self.stop_signals else None
            self.summary.wall_s = time.perf_counter() - started
        return self.summary

    def _outcomes(self, done: IdSet) -> Iterator[Outcome]:
        connect(self.address)
        replicas, threads, gpus = actor_shape(self.replicas, self.threads)
        engine = {**self.engine_options, "n_threads": threads}
        # The read runs where the file is (this node) and reserves no CPU: it is light, and the
        # actors may hold every core (on one machine a reserved CPU would wait for them forever).
        here = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
        dataset = ray.data.read_datasource(JobLines(Path(self.input), self.format, done), num_cpus=0, label_selector=here)
        answered = dataset.map_batches(
            BatchPredictor,
            fn_constructor_kwargs={"format": self.format.value, "engine": engine,
                                   "base": None if self.format is Format.OPENAI else asdict(self.base),
                                   "incomplete_errors": self.incomplete_errors,
                                   "folder": None if self.input == STDIN else str(Path(self.input).resolve().parent)},
            batch_size=ROWS_PER_SLOT * self.parallel,
            # Two tasks an actor holds, batching beside the call in progress; the calls themselves
            # run one at a time (Ray Data's default for a plain method). Letting them overlap, with
            # blocks of one batch (Ray Data maps a block's batches in one task), made a job on one
            # actor slower (`python -m benchmarks ray`, 2-core EPYC: 0.67 of a single process, 0.81
            # as here). Named as Ray 2.60 names it: max_concurrency in ray_remote_args goes in 2.64.
            compute=ray.data.ActorPoolStrategy(size=replicas, max_tasks_in_flight_per_actor=BATCHES_IN_FLIGHT,
                                               max_concurrent_calls_per_actor=BATCHES_IN_FLIGHT),
            num_cpus=threads,
            num_gpus=gpus,
        )
        for row in answered.iter_rows():
            yield Outcome(row["id"], bool(row["ok"]), json.loads(row["record"]), int(row["prompt_tokens"]),
                          int(row["completion_tokens"]), int(row["incomplete"]))


def actor_shape(replicas: int | str, threads: int | None) -> tuple[int, int, float]:
    """(actors, CPU threads each, GPUs each). `auto`: one actor per GPU when the cluster has
    GPUs, else one per node. Threads default to the cluster's CPUs divided between the actors,
    so they do not fight over cores."""
    resources = ray.cluster_resources()
    n_gpus = int(resources.get("GPU", 0))
    if replicas == "auto":
        replicas = n_gpus or len([node for node in ray.nodes() if node["Alive"]])
    replicas = int(replicas)
    if replicas < 1:
        raise LlamabatchError(f"--replicas must be at least 1 or 'auto', got {replicas}")
    if threads is None:
        threads = max(1, int(resources.get("CPU", 1)) // replicas)
    return replicas, threads, 1.0 if n_gpus else 0.0


def connect(address: str | None) -> None:
    """Join the cluster at `address`, or start a local Ray instance (None or 'local')."""
    if ray.is_initialized():
        return
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # our progress line replaces Ray Data's
    ray.data.DataContext.get_current().enable_progress_bars = False
    ray.init(address=None if address in (None, "", "local") else address, log_to_driver=False,
             include_dashboard=False, configure_logging=False)
