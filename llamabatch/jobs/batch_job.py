"""`llamabatch batch`: a job file of any size through one engine, with bounded memory.

The input is read lazily and only a window of requests (a small multiple of the slots) is
tokenized and queued at a time. Each request's result is appended to the output as soon as its
last sequence finishes (completion order; every line carries its id), failures go to an error
file, and a run over the same output skips every id already written, so a killed job resumes.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ..embeddings_format import EmbedSettings
from ..engine import BatchEngine, SamplingParams
from ..engine.embedding import Pooling
from ..errors import EngineBroken, LlamabatchError
from .inputs import STDIN, BadLine, Format, JobLine, RequestReader, peek_ids
from .ledger import IdSet, JsonlLog, digest, find_duplicate
from .manifest import Manifest, job_settings
from .runner import Outcome, RequestRunner
from .vectors import ParquetParts, write_npy


@dataclass
class JobSummary:
    """Counts for one run of a job (a resumed run counts what it skipped apart)."""

    total: int | None  # requests in the input; None when it is read from standard input
    done: int = 0  # answered and written to the output by this run
    skipped: int = 0  # already in the output (or the error file) from an earlier run
    failed: int = 0  # written to the error file by this run
    incomplete: int = 0  # structured outputs cut before their constraint was complete (in either file)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    decode_calls: int = 0
    mean_active_sequences: float = 0.0
    draft_tokens: int = 0  # speculative decoding: drafts verified, and the share kept
    draft_acceptance: float = 0.0
    wall_s: float = 0.0
    stopped_by: str | None = None  # the signal that stopped the job before its end
    broken: str | None = None  # why the engine stopped the job before its end
    estimated_s: float | None = None  # what `batch --estimate` expected, from the stored batch-size measurement

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def complete(self) -> bool:
        return self.stopped_by is None and self.broken is None

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 2), "wall_s": round(self.wall_s, 3),
                "mean_active_sequences": round(self.mean_active_sequences, 3), "draft_acceptance": round(self.draft_acceptance, 4)}

    def embed_dict(self) -> dict:
        """An embedding job's counts: nothing was generated, so no generation figures."""
        kept = ("total", "done", "skipped", "failed", "prompt_tokens", "stopped_by", "broken")
        return {**{k: getattr(self, k) for k in kept}, "wall_s": round(self.wall_s, 3),
                "embedded_tokens_per_s": round(self.prompt_tokens / self.wall_s, 2) if self.wall_s > 0 else 0.0}


class Stopped(Exception):
    """A stop signal arrived before the job started decoding."""


class Job:
    """What every job has, wherever its requests are answered: the input (read lazily), the
    output and error files, and resuming. A subclass answers the requests and sets `settings`
    (what the manifest records); BatchJob answers them with one engine here, RayBatchJob with
    actors on a cluster."""

    settings: dict

    def __init__(
        self,
        input: str | Path,
        output: str | Path,
        *,
        errors: str | Path | None = None,
        base: SamplingParams | None = None,
        retry_errors: bool = False,
        overwrite: bool = False,
        on_progress: Callable[[JobSummary], None] | None = None,
        embed: bool = False,
    ) -> None:
        """`embed`: the input's text lines are texts to embed, not prompts."""
        self.input = input
        self.output = Path(output)
        self.errors = Path(errors) if errors is not None else self.output.with_name(self.output.name + ".errors.jsonl")
        if str(input) != STDIN and Path(input).resolve() in (self.output.resolve(), self.errors.resolve()):
            raise LlamabatchError(f"the output {self.output} would overwrite the input")
        self.reader = RequestReader(input, base, embed)
        self.format = self.reader.format
        if base is not None and self.format is Format.OPENAI:
            self.reader.close()
            raise LlamabatchError(
                "sampling options (--max-tokens, --temperature, ...) apply to prompt files: "
                "the bodies of an OpenAI batch file carry their own"
            )
        self.base = base or SamplingParams()
        self.retry_errors = retry_errors
        self.overwrite = overwrite
        self.on_progress = on_progress or (lambda summary: None)
        self.summary = JobSummary(total=None)
        self._out = JsonlLog(self.output)
        self._err = JsonlLog(self.errors)
        self.stop_signals: list[str] = []

    def request_stop(self, reason: str = "stop") -> None:
        """Admit nothing more (a second call: drop what runs). Safe from a signal handler: it
        only records the request."""
        self.stop_signals.append(reason)

    def record(self, outcome: Outcome) -> None:
        """Write a request's line to the output or the error file, and count it."""
        s = self.summary
        s.incomplete += outcome.incomplete
        if outcome.ok:
            self._out.write(outcome.record)
            s.done += 1
            s.prompt_tokens += outcome.prompt_tokens
            s.completion_tokens += outcome.completion_tokens
        else:
            self._err.write(outcome.record)
            s.failed += 1
        self.on_progress(s)

    def prepare(self) -> IdSet:
        """Everything before the first request runs, in an order that changes no file until the
        job is known to be this one: the manifest checked, what earlier runs answered read back,
        the input surveyed, then the manifest and the output files opened. Returns the ids (with
        their requests' digests) already answered."""
        manifest = Manifest(self.output, self.settings)
        if not self.overwrite:
            manifest.check()
        done = IdSet() if self.overwrite else IdSet.of(self._recorded_ids())
        self.summary.total = self._survey(done)
        manifest.write()
        self._out.open(fresh=self.overwrite)
        self._err.open(fresh=self.overwrite or self.retry_errors)  # retried ids write new failures if they fail again
        return done

    def _recorded_ids(self) -> Iterator[tuple[str, str]]:
        yield from self._out.recorded(self.format.id_field)
        if not self.retry_errors:
            yield from self._err.recorded(self.format.id_field)

    def _survey(self, done: IdSet) -> int | None:
        """Count the input's requests, and before any work refuse a repeated id, an answered
        request the input now asks differently, and answers to requests it no longer has. Not
        for stdin (there each line is checked as it is read). A stop signal ends this pass too:
        a file of millions of lines takes a while."""
        if str(self.input) == STDIN:
            return None

        def pairs() -> Iterator[tuple[str, int]]:
            for id_, n, request in peek_ids(self.input, self.format):
                if self.stop_signals:
                    raise Stopped
                self._check_answered(done, id_, n, request)
                yield id_, n

        ids, duplicate = find_duplicate(pairs)
        if duplicate:
            id_, first, second = duplicate
            raise LlamabatchError(f"duplicate id {id_!r} on lines {first} and {second} of {self.input}: ids must be unique")
        gone = done.ids[~np.isin(done.ids, ids)]
        if gone.size:
            example = next(id_ for id_, _ in self._recorded_ids() if np.isin(np.array(digest(id_), dtype="S16"), gone))
            raise LlamabatchError(
                f"{self.output} answers {gone.size} requests that {self.input} does not have (such as {example!r}): "
                "it is another job's output; use --overwrite or another output"
            )
        return int(ids.size)

    def _check_answered(self, done: IdSet, id_: str, line: int, request: str) -> None:
        """Refuse an input line whose id was answered for another request (another job's output,
        or an input edited since)."""
        recorded = done.request(id_)
        if recorded is None or recorded == request:
            return
        why = "the answer records no request (an older llamabatch wrote it)" if not recorded else "it asked something else then"
        raise LlamabatchError(
            f"line {line} of {self.input} ({id_!r}) is not the request {self.output} answered for that id ({why}): "
            "use --overwrite to start afresh, or another output"
        )

    def pending(self, done: IdSet) -> Iterator[JobLine | BadLine]:
        """The input's requests that `done` (from prepare()) does not hold, read as they are asked for."""
        seen: set[bytes] | None = set() if self.summary.total is None else None  # stdin: duplicates found as they come
        for item in self.reader:
            if item.id in done:
                self._check_answered(done, item.id, item.line, item.digest)  # for stdin; a file was surveyed
                self.summary.skipped += 1
                continue
            if seen is not None:
                key = digest(item.id)
                if key in seen:
                    item = BadLine(item.id, item.line, item.digest, f"duplicate id {item.id!r}: an earlier line has it")
                seen.add(key)
            yield item


class BatchJob(Job):
    """Runs one input file through `engine`, writing `output` and an error file beside it.

    >>> with BatchEngine("gemma3-270m", n_parallel=16) as engine:
    ...     summary = BatchJob(engine, "requests.jsonl", "results.jsonl").run()
    """

    def __init__(
        self,
        engine: BatchEngine,
        input: str | Path,
        output: str | Path,
        *,
        errors: str | Path | None = None,
        base: SamplingParams | None = None,
        retry_errors: bool = False,
        overwrite: bool = False,
        incomplete_errors: bool = False,
        window: int | None = None,
        on_progress: Callable[[JobSummary], None] | None = None,
        embed: EmbedSettings | None = None,
        priority: int = 0,
    ) -> None:
        """`embed` makes it an embedding job (`llamabatch embed`): a text line is a text to embed,
        and the output may be .parquet or .npy as well as JSON Lines. `priority` ranks its
        sequences in an engine others use too (the server's batches)."""
        self.engine = engine
        super().__init__(input, output, errors=errors, base=base, retry_errors=retry_errors, overwrite=overwrite,
                         on_progress=on_progress, embed=embed is not None)
        vectors = self.output.suffix in (".parquet", ".npy")
        if vectors:
            self._vector_output(embed)
        embedding = replace(embed or EmbedSettings(), one_per_line=vectors)
        self.runner = RequestRunner(engine, self.format, window, incomplete_errors, embedding, priority=priority)
        self.settings = job_settings(engine.model_name, engine.model.path, engine.config, self.format, self.base,
                                     embed and embedding, engine.adapters.chosen)

    def _vector_output(self, embed: EmbedSettings | None) -> None:
        """A .parquet output is a folder of parts; a .npy output is assembled from one at the end."""
        if embed is None:
            self.reader.close()
            raise LlamabatchError(f"{self.output.suffix} output is for embeddings (llamabatch embed); batch writes JSON Lines")
        if self.format is Format.OPENAI:
            self.reader.close()
            raise LlamabatchError("OpenAI batch lines are answered with OpenAI's output lines: write them to a .jsonl output")
        if embed.pooling is Pooling.NONE:
            self.reader.close()
            raise LlamabatchError(f"--pooling none gives a vector per token, not a row per line: write .jsonl, not {self.output.suffix}")
        self.parts = self.output if self.output.suffix == ".parquet" else self.output.with_name(self.output.name + ".parts")
        self._out = ParquetParts(self.parts)

    def request_stop(self, reason: str = "stop") -> None:
        """First call: admit nothing more and let running sequences finish. Second: drop them."""
        super().request_stop(reason)
        self.runner.request_stop(reason)

    # -- the run -------------------------------------------------------------------------

    def run(self) -> JobSummary:
        started = time.perf_counter()
        stats = self.engine.stats
        stats_before = (stats.decode_calls, stats.sequence_slots, stats.draft_tokens, stats.draft_accepted)
        try:
            for outcome in self._outcomes(self.prepare()):
                self.record(outcome)
        except Stopped:
            pass
        except EngineBroken as e:  # what finished is written; a resumed run (--retry-errors) does the rest
            self.summary.broken = str(e)
        finally:
            self.close()
            s, (calls, slots, drafted, accepted) = self.summary, stats_before
            s.stopped_by = self.stop_signals[0] if self.stop_signals else None
            s.wall_s = time.perf_counter() - started
            s.decode_calls = stats.decode_calls - calls
            s.mean_active_sequences = (stats.sequence_slots - slots) / s.decode_calls if s.decode_calls else 0.0
            s.draft_tokens = stats.draft_tokens - drafted
            s.draft_acceptance = (stats.draft_accepted - accepted) / s.draft_tokens if s.draft_tokens else 0.0
        return self.summary

    def close(self) -> None:
        """Close the input and the output files (synced to disk); a complete .npy job assembles
        its array now."""
        self.reader.close()
        self._out.close()
        self._err.close()
        if self.output.suffix == ".npy" and self.summary.complete and not self.stop_signals and self.parts.is_dir():
            write_npy(self.parts, self.output)

    def _outcomes(self, done: IdSet) -> Iterator[Outcome]:
        """Every request not in `done`, answered (where the Ray job sends them to its actors)."""
        return self.runner.run(self.pending(done))


@contextmanager
def stop_on_signals(job: Job) -> Iterator[None]:
    """SIGINT and SIGTERM ask the job to stop (twice: at once) instead of killing the process,
    so what finished is written and the job can resume. Only the main thread can install them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: job.request_stop(signal.Signals(signum).name)) for s in handled}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
