"""The batch engine: every step decodes all active sequences with one llama_decode call."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from .catalog import Catalog
from .config import EngineConfig
from .errors import DecodeError, PromptError
from .native import Batch, Context, Model, init_backend
from .results import Event, Result, RunStats
from .sampling import SamplingParams, build_sampler
from .scheduler import Scheduler
from .sequence import Sequence, Status

KV_FULL = 1  # llama_decode's "no free KV slot"


class BatchEngine:
    """Continuous batching over one llama.cpp context.

    >>> with BatchEngine("gemma3-270m", n_parallel=8) as engine:
    ...     results = engine.generate(["The capital of France is", "def fib(n):"])
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        catalog: str | Path | None = None,
        n_parallel: int | None = None,
        n_ctx: int | None = None,
        n_batch: int | None = None,
        n_ubatch: int | None = None,
        n_threads: int | None = None,
        gpu_layers: int | None = None,
        kv_unified: bool | None = None,
        chat: bool | None = None,
        verbose: bool = False,
    ) -> None:
        spec = Catalog.load(catalog).resolve(model)
        self.config = EngineConfig.for_model(
            spec, n_parallel=n_parallel, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
            n_threads=n_threads, gpu_layers=gpu_layers, kv_unified=kv_unified, chat=chat, verbose=verbose,
        )
        self.model_name = spec.name
        self._chat_template = spec.chat_template
        path = spec.gguf_path()
        init_backend(verbose)
        cfg = self.config
        self.model = Model(path, cfg.gpu_layers)
        try:
            self.ctx = Context(
                self.model, n_ctx=cfg.n_ctx, n_batch=cfg.n_batch, n_ubatch=cfg.n_ubatch,
                n_seq_max=cfg.n_parallel, n_threads=cfg.n_threads, kv_unified=cfg.kv_unified,
            )
        except Exception:
            self.model.close()
            raise
        self.vocab = self.model.vocab
        self.batch = Batch(cfg.n_batch)
        self.scheduler = Scheduler(cfg.n_parallel, cfg.n_batch)
        self.stats = RunStats()
        self._next_index = 0

    # -- submitting work -------------------------------------------------------------

    def add(self, prompt: str, params: SamplingParams | None = None, index: int | None = None) -> Sequence:
        """Queue one prompt. Raises PromptError when it cannot run; nothing is queued then."""
        params = params or SamplingParams()
        if index is None:
            index, self._next_index = self._next_index, self._next_index + 1
        if not prompt:
            raise PromptError("empty prompt")
        tokens = self.tokenize_prompt(prompt)
        if len(tokens) > self.ctx.n_ctx_seq:
            raise PromptError(
                f"prompt is {len(tokens)} tokens, longer than the {self.ctx.n_ctx_seq}-token context "
                "of one sequence (raise --ctx or lower --parallel)"
            )
        sampler = build_sampler(params, self.vocab.n_vocab, self.ctx.n_ctx_seq)
        seq = Sequence(index, prompt, params, tokens, len(tokens), sampler=sampler)
        if params.uses_penalties:
            for token in tokens:  # penalties look back over the prompt too, as llama.cpp's server does
                seq.sampler.accept(token)
        self.scheduler.add(seq)
        return seq

    def submit(
        self, prompts: Iterable[str], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Sequence]:
        """Queue prompts (index = position in `prompts`). A prompt that cannot run comes back
        already finished with its error; the others are unaffected."""
        prompts = list(prompts)
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        else:
            params = [params or SamplingParams()] * len(prompts)
        return [self._submit_one(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]

    def _submit_one(self, index: int, prompt: str, params: SamplingParams) -> Sequence:
        try:
            return self.add(prompt, params, index)
        except PromptError as e:
            return Sequence(index, prompt, params, [], 0, status=Status.FINISHED, finish_reason="error", error=str(e))

    def tokenize_prompt(self, prompt: str) -> list[int]:
        if self.config.chat:
            prompt = self.model.apply_chat_template([{"role": "user", "content": prompt}], self._chat_template)
        return self.vocab.tokenize(prompt)

    # -- running -----------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[Event]:
        """Schedule, fill one batch, decode it once, sample each sequence that is due a token."""
        started = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        self._fill_batch(scheduled)
        self.stats.decode_calls += 1
        self.stats.sequence_slots += len(scheduled)
        try:
            self.ctx.decode(self.batch)
        except DecodeError as e:
            if e.code != KV_FULL:
                raise
            return self._recover_kv_full(scheduled)
        events = [event for seq in scheduled if (event := self._advance(seq)) is not None]
        self._record_step_time(started)
        return events

    def run(self) -> Iterator[Event]:
        """Step until every queued sequence has finished, yielding each step's events."""
        while self.has_work:
            yield from self.step()

    def generate(
        self, prompts: Iterable[str], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Result]:
        """Run prompts to completion; results in input order. A bad prompt fails only its own result."""
        sequences = self.submit(prompts, params)
        for _ in self.run():
            pass
        return [seq.result() for seq in sequences]

    def stream(
        self, prompts: Iterable[str], params: SamplingParams | list[SamplingParams] | None = None
    ) -> Iterator[Event]:
        """Run prompts, yielding each token's event as it is sampled (Event.index is the input position)."""
        for seq in self.submit(prompts, params):
            if seq.status is Status.FINISHED:
                yield Event(seq.index, None, "", "error", seq.error)
        yield from self.run()

    def reset_stats(self) -> None:
        self.stats = RunStats()

    # -- inside a step ---------------------------------------------------------------

    def _fill_batch(self, scheduled: list[Sequence]) -> None:
        self.batch.clear()
        for seq in scheduled:
            samples = seq.n_chunk == seq.n_pending  # the chunk ends at its newest token
            row = self.batch.add(seq.chunk(), seq.n_past, seq.seq_id, logits_last=samples)
            seq.i_batch = row if samples else -1

    def _advance(self, seq: Sequence) -> Event | None:
        """The decode took the chunk into the KV cache; sample if the sequence is due a token."""
        self.stats.prompt_tokens_evaluated += max(0, min(seq.n_chunk, seq.n_prompt - seq.n_past))
        seq.n_past += seq.n_chunk
        if seq.i_batch < 0:
            return None
        token = seq.sampler.sample(self.ctx, seq.i_batch)
        seq.tokens.append(token)
        self.stats.completion_tokens += 1
        if seq.t_first_token is None:
            seq.t_first_token = time.perf_counter()
        if self.vocab.is_eog(token) and not seq.params.ignore_eos:
            return self._finish(seq, token, "", "stop")
        text = seq.text.push(self.vocab.piece(token))
        if seq.text.stopped:
            return self._finish(seq, token, text, "stop")
        # The new token is decoded at position len(tokens) - 1 next step: it needs a cell.
        if seq.n_generated >= seq.params.max_tokens or len(seq.tokens) > self.ctx.n_ctx_seq:
            return self._finish(seq, token, text, "length")
        return Event(seq.index, token, text)

    def _finish(self, seq: Sequence, token: int | None, text: str, reason: str, error: str | None = None) -> Event:
        text += seq.text.finish()
        seq.finish_reason, seq.error = reason, error
        seq.t_finished = time.perf_counter()
        self.ctx.remove_sequence(seq.seq_id)
        self.scheduler.release(seq)
        seq.sampler.close()
        return Event(seq.index, token, text, reason, error)

    def _recover_kv_full(self, scheduled: list[Sequence]) -> list[Event]:
        """No KV slot for this batch: undo it, then make room by preempting or cutting a sequence."""
        for seq in scheduled:  # drop whatever part of the batch llama.cpp did store
            self.ctx.remove_sequence(seq.seq_id, from_pos=seq.n_past)
        if len(self.scheduler.running) > 1:
            victim = self.scheduler.running[-1]  # the most recently admitted
            self.ctx.remove_sequence(victim.seq_id)
            self.scheduler.preempt(victim)
            self.stats.preemptions += 1
            return []
        seq = self.scheduler.running[0]
        return [self._finish(seq, None, "", "length", "KV cache full: the sequence does not fit even alone")]

    def _record_step_time(self, started: float) -> None:
        if self.stats.first_step_at is None:
            self.stats.first_step_at = started
        self.stats.last_step_at = time.perf_counter()

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Free every native handle: samplers of unfinished sequences, batch, context, then model."""
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.sampler is not None:
                seq.sampler.close()
        self.batch.close()
        self.ctx.close()
        self.model.close()

    def __enter__(self) -> BatchEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
