"""Requests through one engine: a bounded window of them queued, each request's output line
handed back the moment its last sequence finishes. `llamabatch batch` writes what it hands
back to files; the Ray stage returns it as rows."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from ..engine import BatchEngine, Event, SamplingParams, Sequence, Status
from ..errors import LlamabatchError
from ..chat.conversation import Answer
from ..openai_format import EngineInputs, check_base_model, engine_inputs, failure, refusal_status, usage
from .inputs import BadLine, Format, JobLine
from ..embeddings_format import EmbedSettings, embedding_tokens
from .records import embedding_record, error_record, incomplete_record, result_record

WINDOW_PER_SLOT = 2  # sequences queued or running per slot: enough that a freed slot never waits
IDLE = object()  # what a never-ending source yields when it has nothing now: step on, ask again later


@dataclass(frozen=True)
class Outcome:
    """One request's line: its output line when `ok`, else its error line."""

    id: str
    ok: bool
    record: dict
    prompt_tokens: int = 0
    completion_tokens: int = 0
    incomplete: int = 0  # structured outputs cut before their constraint was complete


@dataclass(eq=False)
class _Open:
    """A request in the engine: its sequences, and how many have not finished yet."""

    request: JobLine
    sequences: list[Sequence] = field(default_factory=list)
    n_open: int = 0
    answer: Answer | None = None  # chat: how its answers' tool calls and reasoning are read


class RequestRunner:
    """Feeds requests to `engine` and yields an Outcome per request, in completion order."""

    def __init__(
        self, engine: BatchEngine, fmt: Format, window: int | None = None, incomplete_errors: bool = False,
        embedding: EmbedSettings = EmbedSettings(), priority: int = 0, priority_class: str = "batch",
    ) -> None:
        self.engine = engine
        self.format = fmt
        self.incomplete_errors = incomplete_errors  # answers with a cut structured output go to the error file
        self.embedding = embedding
        # Where its sequences rank (queue.rank): a line's own `priority` is added to this.
        self.priority, self.priority_class = priority, priority_class
        self._to_embed: list[tuple[JobLine, list[list[int]]]] = []  # embedding requests, pooled a decode's worth at a time
        self._to_embed_tokens = 0
        self.window = window or WINDOW_PER_SLOT * engine.config.n_parallel
        self.stop_signals: list[str] = []  # set by signal handlers, acted on between steps
        self._stopping = False
        self._exhausted = False
        self._open: dict[int, _Open] = {}  # sequence uid -> its request
        self._n_open_sequences = 0
        self._created = int(time.time())

    def request_stop(self, reason: str = "stop") -> None:
        """First call: admit nothing more and let running sequences finish. Second: drop them.
        Safe from a signal handler: it only records the request."""
        self.stop_signals.append(reason)

    def run(self, requests: Iterable[JobLine | BadLine]) -> Iterator[Outcome]:
        """Every request answered, this runner stepping the engine itself."""
        requests = iter(requests)
        while True:
            yield from self.feed(requests)
            if not self.engine.has_work:
                if self.finished:
                    return
                continue
            for event in self.engine.step():
                yield from self.on_event(event)

    # -- driven from outside: the server's worker steps one engine for many runners ----------

    def feed(self, requests: Iterator[JobLine | BadLine]) -> Iterator[Outcome]:
        """Between steps: act on stop requests, queue requests until the window is full, and pool
        the embedding requests that came in. Yields the requests answered without a step."""
        self._act_on_signals()
        while not (self._exhausted or self._stopping) and self._n_open_sequences < self.window and not self._pack_waiting:
            item = next(requests, None)
            if item is None:
                self._exhausted = True
            elif item is IDLE:
                break
            elif isinstance(item, BadLine):
                yield self._failure(item, item.message, item.status)
            elif item.embedding is not None:
                yield from self._submit_embedding(item)
            else:
                yield from self._submit(item)
        if self._to_embed:  # what the window let in: pooled before the next generation step
            yield from self._embed()

    def on_event(self, event: Event) -> Iterator[Outcome]:
        """A step's event: the request whose last sequence it finished is answered."""
        if event.finish_reason is not None:
            yield from self._finished(event.uid)

    def sequence(self, uid: int) -> Sequence | None:
        """The open sequence with this uid, if one of this runner's requests has it."""
        req = self._open.get(uid)
        return None if req is None else next((s for s in req.sequences if s.uid == uid), None)

    def open_sequences(self) -> list[Sequence]:
        return [s for req in set(self._open.values()) for s in req.sequences if s.finish_reason is None]

    @property
    def finished(self) -> bool:
        """The input is read (or the runner stopped) and every request it queued is answered."""
        return (self._exhausted or self._stopping) and not self._open and not self._to_embed

    def _act_on_signals(self) -> None:
        if not self.stop_signals:
            return
        if not self._stopping:  # first: requests not yet running are left for a resumed run
            self._stopping = True
            self._drop(lambda req: any(s.status is Status.WAITING for s in req.sequences))
        if len(self.stop_signals) > 1:  # second: drop the running ones too
            self._drop(lambda req: True)

    def _drop(self, which: Callable[[_Open], bool]) -> None:
        for req in set(self._open.values()):
            if which(req):
                for seq in req.sequences:
                    self.engine.cancel(seq)
                    self._open.pop(seq.uid, None)
                self._n_open_sequences -= req.n_open

    def _submit(self, request: JobLine) -> Iterator[Outcome]:
        """Queue the request's prompts; one that cannot run fails the request alone."""
        req = _Open(request)
        try:
            inputs = (
                engine_inputs(request.body, self.engine) if request.body is not None else EngineInputs([request.engine_prompt()], self._params(request))
            )
            req.answer, prompts, params = inputs.answer, inputs.prompts, inputs.params
            for i, prompt in enumerate(prompts):
                try:
                    priority = self.priority + (request.body.priority if request.body is not None else 0)
                    # A line is written whole: no one reads its tokens as they come (Sequence.streamed).
                    req.sequences += self.engine.add(prompt, params, index=i, priority=priority, priority_class=self.priority_class,
                                                     streamed=False)
                except LlamabatchError as e:
                    raise LlamabatchError(f"prompt {i}: {e}" if len(prompts) > 1 else str(e)) from None
        except LlamabatchError as e:
            for seq in req.sequences:
                self.engine.cancel(seq)
            yield self._failure(request, str(e), refusal_status(e))
            return
        open_sequences = [seq for seq in req.sequences if seq.finish_reason is None]  # max_tokens 0 ends some at once
        if not open_sequences:
            yield self._result(req)
            return
        req.n_open = len(open_sequences)
        self._n_open_sequences += req.n_open
        for seq in open_sequences:
            self._open[seq.uid] = req

    def _params(self, request: JobLine) -> SamplingParams:
        """A JSONL line's params, its adapters chosen by its model and lora fields (as the server's)."""
        if request.model is None and request.lora is None:
            return request.params
        adapters = self.engine.adapters.choose(request.model, request.lora, {self.engine.model_name})
        return replace(request.params, adapters=adapters)

    def _submit_embedding(self, request: JobLine) -> Iterator[Outcome]:
        """Tokenize the request's texts (one refused fails the request alone) and hold them: texts
        of many requests share each decode."""
        try:
            if self.embedding.one_per_line and not request.embedding.single:
                raise LlamabatchError("a .parquet or .npy output holds one vector a line: give one text in 'input'")
            check_base_model(request.embedding.model, self.engine)
            tokens = embedding_tokens(self.engine, request.embedding, self.embedding.pooling, self.embedding.truncate)
        except LlamabatchError as e:
            yield self._failure(request, str(e), refusal_status(e))
            return
        self._to_embed.append((request, tokens))
        self._to_embed_tokens += sum(map(len, tokens))

    @property
    def _pack_waiting(self) -> bool:
        """Enough texts wait to fill the embedding context: admit no more until they are pooled
        (and signals and generation steps have had their turn)."""
        return bool(self._to_embed) and self._to_embed_tokens >= self.engine.embedder(self.embedding.pooling).n_tokens

    def _embed(self) -> Iterator[Outcome]:
        waiting, self._to_embed, self._to_embed_tokens = self._to_embed, [], 0
        try:
            answers = self.engine.embedder(self.embedding.pooling).embed_groups([lists for _, lists in waiting])
        except LlamabatchError as e:  # the decode failed: the requests it carried fail (500, as the server's)
            for request, _ in waiting:
                yield self._failure(request, str(e), 500)
            return
        for (request, lists), rows in zip(waiting, answers):
            n_tokens = sum(map(len, lists))
            try:
                record = embedding_record(self.format, request, rows, n_tokens, self.engine.model_name, self.embedding)
            except LlamabatchError as e:  # dimensions beyond the model's width
                yield self._failure(request, str(e), 400)
            else:
                yield Outcome(request.id, True, record, n_tokens)

    def _finished(self, uid: int) -> Iterator[Outcome]:
        req = self._open.pop(uid, None)
        if req is None:
            return
        req.n_open -= 1
        self._n_open_sequences -= 1
        if req.n_open:
            return
        verdict = failure([s.result() for s in req.sequences])  # the server's verdict, so the line is the server's answer
        if verdict is not None:
            yield self._failure(req.request, verdict.message, verdict.status)
        else:
            yield self._result(req)

    def _result(self, req: _Open) -> Outcome:
        results = [s.result() for s in req.sequences]
        counted = usage(results)
        record = result_record(self.format, req.request, results, self.engine, self._created, req.answer)
        cut = [r for r in results if r.incomplete]
        ok = not (cut and self.incomplete_errors)
        if not ok:  # the whole answer, marked, in the error file: nothing generated is lost
            message = f"choice {cut[0].sample}: the structured output was cut by max_tokens (or the context) before it was complete"
            record = incomplete_record(record, req.request, message)
        return Outcome(req.request.id, ok, record, counted["prompt_tokens"], counted["completion_tokens"], len(cut))

    def _failure(self, item: JobLine | BadLine, message: str, status: int | None) -> Outcome:
        return Outcome(item.id, False, error_record(self.format, item, message, status))
