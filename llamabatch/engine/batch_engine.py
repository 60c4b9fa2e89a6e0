"""The batch engine: the public face over its parts (runtime, intake, stepper), and the
convenience APIs (generate, score, stream, embed, rerank) built on them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from ..catalog import Catalog
from ..chat import Tools
from ..chat.conversation import ChatPrompt
from ..errors import ConfigError, LlamabatchError, PromptError
from .adapters import AdapterInfo
from .config import EngineConfig
from .sampling.constraints import Grammars
from .embedding import Embedder, Pooling, finish
from .infill import Infill, infill_tokens
from .intake import Intake, PromptInput
from .sampling.picker import Picker
from .postprocess import Postprocessor, event
from .results import Event, Result, RunStats, Score
from .runtime import Runtime
from .sampling.params import SamplingParams
from .scheduling.fillers import LONE_ROW_MAX_CELLS
from .scheduling.scheduler import Scheduler
from .scoring import scored_prompts, total_score
from .sequence import Sequence, Status
from .memory.reuse import PrefixReuse
from .snapshot import IDLE, EngineFacts, EngineSnapshot, take
from .stepper import Stepper

# Logits a step may ask for when prompts are scored (each row is a vocabulary of floats): 256
# rows of Gemma 3's 262,144, or every row of a batch for a small vocabulary.
LOGITS_BUDGET_BYTES = 256 << 20
# The snapshot other threads read is published after a step that changed who waits or runs, at
# least this often otherwise, and when the engine falls idle: taking one reads every running
# sequence, which a step of a steady batch need not pay for.
PUBLISH_EVERY_S = 0.025


class AdapterBusy(LlamabatchError):
    """An adapter asked to unload while sequences use it."""


class BatchEngine:
    """Continuous batching over one llama.cpp context.

    >>> with BatchEngine("gemma3-270m", n_parallel=8) as engine:
    ...     results = engine.generate(["The capital of France is", "def fib(n):"])
    """

    def __init__(self, model: str | Path | None = None, *, catalog: str | Path | None = None, **settings) -> None:
        """`model`: a catalog name or a GGUF path (default: the catalog's default model);
        `catalog`: a models.toml instead of the packaged one. `settings` are EngineConfig's fields
        (n_parallel, n_ctx, n_batch, kv_unified, speculative, cache_ram, chat_template, verbose,
        ...): each one given and not None overrides the model's catalog default, else the engine's."""
        models = Catalog.load(catalog)
        spec = models.resolve(model)
        self.config = cfg = EngineConfig.for_model(spec, **settings)
        self.model_name = spec.name
        draft_path = models.resolve(cfg.draft_model).gguf_path() if cfg.draft_model else None
        self.runtime = runtime = Runtime(spec, cfg, draft_path)
        try:
            self._assemble(runtime)
        except BaseException:
            runtime.close()
            raise

    def _assemble(self, runtime: Runtime) -> None:
        """The parts over the loaded runtime, each handed only what it works on."""
        cfg = self.config
        # The handles, by the names callers read them by (the runtime owns and frees them).
        self.model, self.adapters, self.ctx, self.memory = runtime.model, runtime.adapters, runtime.ctx, runtime.memory
        self.vocab, self.batch, self.chat = runtime.vocab, runtime.batch, runtime.chat
        self.speculator, self.prompt_cache = runtime.speculator, runtime.prompt_cache
        self.scheduler = self._scheduler()
        self.grammars = Grammars(self.vocab)
        self.stats = RunStats()  # one object every part counts into
        self.intake = Intake(cfg, runtime, self.scheduler, self.grammars)
        self.reuse = PrefixReuse(self.memory, self.scheduler, self.prompt_cache, self.stats, self.adapters.n_fixed)
        self.post = Postprocessor(cfg, self.vocab, self.memory, self.scheduler, self.stats)
        self.picker = Picker(self.grammars, runtime.scratch, cfg.n_threads)  # its sampling threads are closed with the engine
        self.stepper = Stepper(cfg, runtime, self.scheduler, self.reuse, self.picker, self.post, self.stats)
        self.facts = self._facts()
        self.snapshot: EngineSnapshot = IDLE  # what other threads read (publish)
        self._published_at = 0.0
        self.publish()

    def _facts(self) -> EngineFacts:
        cfg, ctx = self.config, self.ctx
        return EngineFacts(
            model=self.model_name, n_parallel=cfg.n_parallel, n_ctx=ctx.n_ctx, n_ctx_seq=ctx.n_ctx_seq,
            n_vocab=self.vocab.n_vocab, cache_type_k=ctx.cache_types[0], cache_type_v=ctx.cache_types[1],
            flash_attn=ctx.flash_attn, memory_family=self.memory.caps.family.value,
            checkpoint_memory=cfg.checkpoint_memory if self.memory.checkpointing else 0,
            memory_bytes=self.model.size_bytes + ctx.kv_bytes, adapters=tuple(self.adapters.info),
            default_adapters=self.adapters.default, rpc=tuple(cfg.rpc),
        )

    def _scheduler(self) -> Scheduler:
        cfg, float_weights = self.config, self.model.float_weights
        return Scheduler(
            cfg.n_parallel, self.ctx.n_batch, cfg.share_prefixes, deterministic=cfg.deterministic, n_streams=self.runtime.n_streams,
            # Float weights round differently for one row than for two (Stepper.filler_logits): every
            # lone row gets a deterministic filler. (Quantized weights measured the same on both paths.)
            lone_row_max_cells=0 if float_weights else LONE_ROW_MAX_CELLS,
            max_outputs=LOGITS_BUDGET_BYTES // (4 * self.vocab.n_vocab), policy=cfg.scheduling,
            # Memory that cannot be cut is checkpointed where prefills stop: every checkpoint_every
            # prompt tokens, at a prompt's end, where a reused prefix stopped matching.
            checkpoint_every=self.runtime.checkpoint_every, step_target=None if cfg.step_target == "auto" else cfg.step_target,
        )

    # -- submitting work -------------------------------------------------------------

    def prepare(self, prompts: list[PromptInput], params: SamplingParams) -> list[PromptInput]:
        """Tokenize text prompts and compile the constraint ahead of submit(), on the caller's
        thread, beside running steps (Intake.prepare): the same prompts, as submit() takes them."""
        return self.intake.prepare(prompts, params)

    def add(
        self, prompt: PromptInput, params: SamplingParams | None = None, index: int | None = None,
        *, score_from: int | None = None, priority: int = 0, priority_class: str = "interactive", streamed: bool = True,
    ) -> list[Sequence]:
        """Queue a prompt (text, token ids, or an MediaPrompt) for params.n samples, which share its KV. With
        score_from (or params.prompt_logprobs, which scores from the second token), the prompt's
        tokens from that index on get their log-probabilities as it is decoded. A lower priority
        runs first (queue.rank), preempting worse-ranked sequences when no slot is free.
        `streamed`: its tokens are read as they come, an event each, and a step budget
        (step_target) keeps their gaps short; False: only its end is awaited, its last event
        (with its Result) is its only one, and prompts beside it are read in whole chunks (its
        gaps no one sees; its prompt neighbours' first tokens come sooner).
        Raises PromptError (or SamplingError, ConstraintError) when it cannot run; nothing is
        queued then."""
        return self.intake.add(prompt, params, index, score_from=score_from, priority=priority, priority_class=priority_class, streamed=streamed)

    def submit(
        self, prompts: Iterable[PromptInput], params: SamplingParams | list[SamplingParams] | None = None,
        *, priority: int = 0, priority_class: str = "interactive", streamed: bool = True,
    ) -> list[Sequence]:
        """Queue prompts (index = position in `prompts`); n samples each, in order. A prompt that
        cannot run comes back already finished with its error; the others are unaffected.
        `priority`, `priority_class` and `streamed` as add() takes them."""
        return self.intake.submit(prompts, params, priority=priority, priority_class=priority_class, streamed=streamed)

    def tokenize_prompt(self, prompt: str) -> list[int]:
        """A prompt's tokens as the engine decodes them (with --chat, as a user message)."""
        return self.intake.tokenize_prompt(prompt)

    def prompt_length(self, prompt: PromptInput) -> int:
        """The positions a prompt fills as the engine decodes it (an image's or a clip's as its
        projector cuts it, counted without encoding it)."""
        return self.intake.n_positions(prompt)

    @property
    def media_encoded(self) -> int:
        """Images the projector encoded since the engine was made (one shown again is not encoded again)."""
        projector = self.runtime.projector
        return 0 if projector is None else projector.n_encoded

    def chat_prompt(
        self, messages: list[dict], tools: Tools | None = None, template_kwargs: dict | None = None, reasoning_budget: int = -1,
    ) -> ChatPrompt:
        """The prompt for chat messages with the model's template (Chat.prompt). Raises
        ChatTemplateError (a PromptError) for a model without one, or messages its template refuses."""
        return self.intake.chat_prompt(messages, tools, template_kwargs, reasoning_budget)

    def infill_prompt(self, gap: Infill, max_tokens: int = 0) -> list[int]:
        """The prompt that asks the model for the middle of a gap (engine.infill), within one
        sequence's context less `max_tokens` for the answer. Raises a PromptError naming the FIM
        tokens the model lacks."""
        ctx = self.runtime.ctx
        return infill_tokens(self.vocab, gap, ctx.n_batch, ctx.n_ctx_seq, max_tokens)

    # -- running -----------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def broken(self) -> str | None:
        """Why the engine cannot go on (MAX_FAILED_STEPS steps in a row decoded nothing), once it cannot."""
        return self.stepper.broken

    def step(self) -> list[Event]:
        """One step (Stepper.step): admit, schedule, decode every scheduled sequence in one batch,
        sample those due a token; the events of the sequences it moved. Raises EngineBroken once
        the engine is broken."""
        events = self.stepper.step()
        now = time.perf_counter()
        if self.scheduler.version != self.snapshot.version or now - self._published_at >= PUBLISH_EVERY_S or not self.scheduler.running:
            self.publish(now)
        return events

    def publish(self, now: float | None = None) -> None:
        """Publish the engine's state as `snapshot`, for other threads (EngineSnapshot). On the
        engine's thread; step() publishes when due, a caller may after queueing or cancelling."""
        self.snapshot = take(self.scheduler, self.memory, self.stats, self.prompt_cache, self.broken)
        self._published_at = time.perf_counter() if now is None else now

    def run(self) -> Iterator[Event]:
        """Step until every queued sequence has finished, yielding each step's events."""
        while self.has_work:
            yield from self.step()

    def generate(
        self, prompts: Iterable[PromptInput], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Result]:
        """Run prompts to completion; results in input order (n per prompt when params.n > 1).
        A bad prompt fails only its own results. Nothing is streamed: prompts are read in whole
        chunks beside its decoding sequences, whatever the step budget (add())."""
        sequences = self.submit(prompts, params, streamed=False)
        for _ in self.run():
            pass
        return [seq.result() for seq in sequences]

    def score(self, items: Iterable[str | tuple[str, str]], *, bos: bool = True, chunk: int | None = None,
              progress: Callable[[int, int], None] | None = None) -> list[Score]:
        """Log-probabilities of texts (every token after the first) or of continuations after
        their contexts, many per llama_decode, with logits only at the scored positions.
        With chunk, a text is cut into chunk-token windows, each starting with BOS and scored on
        its second half, as llama.cpp's llama-perplexity does. Results in input order; an item
        that cannot be scored fails alone. `progress` hears the windows scored of all, as they end."""
        params = SamplingParams(max_tokens=0, temperature=0)
        sequences: dict[int, list[Sequence]] = {}
        errors: dict[int, str] = {}
        for index, item in enumerate(items):
            try:
                for tokens, score_from in scored_prompts(self.vocab, item, bos, chunk):
                    sequences.setdefault(index, []).extend(self.add(tokens, params, index, score_from=score_from))
            except PromptError as e:
                for seq in sequences.pop(index, []):
                    self.cancel(seq)
                errors[index] = str(e)
        total, done = sum(map(len, sequences.values())), 0
        for e in self.run():
            if e.finish_reason is not None and progress is not None:
                done += 1
                progress(done, total)
        return [
            Score(i, 0.0, 0, False, errors[i]) if i in errors else total_score(i, sequences[i])
            for i in range(len(sequences) + len(errors))
        ]

    def stream(
        self, prompts: Iterable[PromptInput], params: SamplingParams | list[SamplingParams] | None = None
    ) -> Iterator[Event]:
        """Run prompts, yielding each token's event as it is sampled (Event.index is the input position)."""
        for seq in self.submit(prompts, params):
            if seq.status is Status.FINISHED:  # refused, or nothing to do (max_tokens 0)
                yield event(seq, None, "", seq.finish_reason, seq.error)
        yield from self.run()

    def cancel(self, seq: Sequence, error: str | None = None) -> Event | None:
        """Stop a sequence now (its client went away; or, with `error`, it fails for that reason):
        a queued one leaves the queue, a running one frees its slot at once. Returns its last
        event, or None if it had already finished."""
        if seq.status is Status.FINISHED:
            return None
        event = self.post.finish(seq, None, "", "cancelled" if error is None else "error", error)
        self.publish()  # (the engine may take no further step to publish it)
        return event

    def abandon(self, seq: Sequence, error: str) -> Event:
        """End a sequence of a broken engine with `error`, touching nothing of llama.cpp's."""
        seq.end("error", error)
        return event(seq, None, "", "error", error)

    def load_adapter(self, name: str, path: str | Path, scale: float = 1.0) -> AdapterInfo:
        """Load a LoRA adapter while the engine runs (between steps, on its thread): requests then
        name it as their model, or by its id in their `lora` field. ModelError for a file that is
        not an adapter of this model, ConfigError for a name in use."""
        info = self.adapters.load(name, Path(path), scale)
        self._adapters_changed()
        return info

    def unload_adapter(self, name: str) -> AdapterInfo:
        """Free a LoRA adapter no queued or running sequence uses. AdapterBusy while one does,
        UnknownModel for no adapter of that name, ConfigError for one of the --lora default set."""
        adapter = self.adapters.named(name)
        using = sum(any(id == adapter.id for id, _ in seq.adapters) for seq in [*self.scheduler.running, *self.scheduler.waiting])
        if using:
            raise AdapterBusy(f"LoRA adapter {name!r} is used by {using} queued or running sequence(s): unload it once they are done")
        info = self.adapters.unload(self.ctx, name)
        self._adapters_changed()
        return info

    def _adapters_changed(self) -> None:
        self.facts = self._facts()
        self.publish()

    def reset_stats(self) -> None:
        self.stats.reset()
        self.publish()

    def drop_cached_prefixes(self) -> None:
        """Free the KV that finished sequences left in their slots for later prompts."""
        self.reuse.drop_cached_prefixes()

    # -- embeddings --------------------------------------------------------------------

    def embedder(self, pooling: str | Pooling | None = None) -> Embedder:
        """The embedding context for `pooling` (by default the GGUF's, else mean), made on first
        use beside the generation context, on the same weights."""
        return self.runtime.embedder(pooling)

    def embed(
        self, inputs: list[str | list[int]], *, normalize: bool = True, pooling: str | Pooling | None = None,
        truncate: bool = False, dimensions: int | None = None,
    ) -> np.ndarray:
        """One vector per input (text or token ids), a row each, many inputs per decode. Raises
        PromptError for an empty input, or one longer than an embedding takes (unless truncate)."""
        embedder = self.embedder(pooling)
        if embedder.pooling is Pooling.RANK:
            raise ConfigError(f"{self.model_name} is a reranker (rank pooling): use rerank(), it does not embed")
        if embedder.pooling is Pooling.NONE:
            raise ConfigError("pooling none gives a vector per token: use token_embeddings()")
        vectors = embedder.embed([embedder.tokens(text, truncate) for text in inputs])
        return finish(vectors, normalize, dimensions)

    def token_embeddings(self, inputs: list[str | list[int]], *, normalize: bool = True, truncate: bool = False) -> list[np.ndarray]:
        """No pooling: for each input a matrix with a row per token (the last layer's hidden
        states, as llama.cpp's pooling none gives them), many inputs per decode."""
        embedder = self.embedder(Pooling.NONE)
        return [finish(m, normalize) for m in embedder.stream(embedder.tokens(text, truncate) for text in inputs)]

    def rerank(self, query: str, documents: list[str], *, truncate: bool = False) -> np.ndarray:
        """Each document's relevance to the query (a reranker's first label: for Qwen3 rerankers
        the probability of "yes"); ConfigError for a model without a rank head."""
        embedder = self.embedder(Pooling.RANK)
        return embedder.embed([embedder.pair_tokens(query, doc, truncate) for doc in documents])[:, 0]

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Free the samplers of unfinished sequences, keep the slots' prompts where the prompt
        cache has a disk tier (they outlive the process), then every native handle (Runtime.close)."""
        self.picker.close()
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            seq.close_samplers()
        cache = self.prompt_cache
        if cache is not None and cache.folder is not None and self.broken is None:
            self.reuse.keep_free_slots()
        self.runtime.close()

    def __enter__(self) -> BatchEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
