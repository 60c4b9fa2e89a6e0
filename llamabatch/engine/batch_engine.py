"""The batch engine: every step decodes all active sequences with one llama_decode call."""

from __future__ import annotations

import itertools
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from ..catalog import Catalog
from ..chat import ChatTemplate, Tools
from ..chat.conversation import Chat, ChatPrompt
from .adapters import Adapters, AdapterSet
from .config import RPC_TIMEOUT_S, EngineConfig
from .constraints import Constraint, Grammars
from .embedding import MAX_TEXTS_PER_DECODE, Embedder, Pooling, finish, model_pooling
from ..errors import ChatTemplateError, ConfigError, ModelError, ConstraintError, DecodeError, EngineBroken, PromptError, SamplingError
from .memory import Family, Memory, MemoryRefused
from .native import INVALID_BATCH, KV_FULL, Batch, Context, Model, init_backend, use_row_invariant_matmul
from .prompt_cache import MIN_TOKENS as PROMPT_CACHE_MIN_TOKENS, CachedPrompt, PromptCache, fingerprint
from .rpc import guard as rpc_guard, local_accelerators, remote_devices
from .results import Event, Result, RunStats, Score
from .chain import build_sampler
from .sampling import SamplingParams, score_rows, token_logprob
from .scheduler import LONE_ROW_MAX_CELLS, Filler, Scheduler
from .sequence import Sequence, Status
from .rows import lay_out, lay_out_decodes
from .scoring import scored_prompts, total_score
from .speculator import Speculator
from .thinking import Thought
from .truncation import Scratch

# Logits a step may ask for when prompts are scored (each row is a vocabulary of floats): 256
# rows of Gemma 3's 262,144, or every row of a batch for a small vocabulary.
LOGITS_BUDGET_BYTES = 256 << 20
# A step that decodes nothing fails the sequences it carried; this many in a row (different
# batches each time) mean the context itself is broken, and the engine stops.
MAX_FAILED_STEPS = 3


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
        self.config = EngineConfig.for_model(spec, **settings)
        draft_path = models.resolve(self.config.draft_model).gguf_path() if self.config.draft_model else None
        self.model_name = spec.name
        path = spec.gguf_path()
        cfg = self.config
        init_backend(cfg.verbose)
        if cfg.deterministic:  # kernels that do not change with the number of rows (docs/guides/deterministic.md)
            use_row_invariant_matmul()
        # Deterministic mode needs a second KV stream even for one slot: fillers decode there.
        n_streams = max(cfg.n_parallel, 2) if cfg.deterministic else cfg.n_parallel
        with ExitStack() as undo:  # a handle that fails to load frees those made before it
            self.model = Model(path, cfg.gpu_layers, repack=not cfg.deterministic, **self._placement())
            undo.callback(self.model.close)
            self.adapters = Adapters(self.model, spec.adapters, cfg.lora)
            undo.callback(self.adapters.close)
            self.ctx = Context(
                self.model, n_ctx=cfg.n_ctx * n_streams // cfg.n_parallel, n_batch=cfg.n_batch, n_ubatch=cfg.n_ubatch,
                n_seq_max=n_streams, n_threads=cfg.n_threads, kv_unified=cfg.kv_unified,
                cache_type_k=cfg.cache_type_k, cache_type_v=cfg.cache_type_v, flash_attn=cfg.flash_attn,
                n_rs_seq=self._rollback_snapshots(),
            )
            undo.callback(self.ctx.close)
            # Without shared prefixes a finished sequence's memory is freed: no prefix outlives it
            # to be checkpointed (transient checkpoints, for drafts and fillers, need no budget).
            self.memory = Memory(self.ctx, self.model, cfg.checkpoint_memory if cfg.share_prefixes else 0)
            self.chat = self._chat(spec.chat_template)  # a --chat-template refused frees what was loaded
            self.speculator = Speculator.for_config(cfg, self.model.vocab, self.ctx.n_ctx, draft_path)
            self.prompt_cache = self._prompt_cache(path)
            undo.pop_all()  # loaded: close() frees them from now on
        self.vocab = self.model.vocab
        self.batch = Batch(self.ctx.n_batch)
        self._scratch = Scratch(self.vocab.n_vocab)  # buffers sampled rows reuse
        # Float weights go through llamafile's sgemm from 2 rows and ggml's vec_dot for 1, which
        # round differently: every lone row then gets a filler, one that asks for logits too, so
        # the output layer never multiplies a single row either. (Quantized weights measured the
        # same on both paths; there a filler only steers flash attention.)
        float_weights = self.model.float_weights
        self._filler_logits = float_weights
        self.scheduler = Scheduler(
            cfg.n_parallel, self.ctx.n_batch, cfg.share_prefixes, batch_invariant=cfg.deterministic, n_streams=n_streams,
            lone_row_max_cells=0 if float_weights else LONE_ROW_MAX_CELLS,
            max_outputs=LOGITS_BUDGET_BYTES // (4 * self.vocab.n_vocab), policy=cfg.scheduling,
            # Memory that cannot be cut is checkpointed where prefills stop: every checkpoint_every
            # prompt tokens, at a prompt's end, where a reused prefix stopped matching.
            checkpoint_every=self._checkpoint_every(),
        )
        self.grammars = Grammars(self.vocab)
        self.stats = RunStats()
        self.broken: str | None = None  # why the engine cannot go on, once it cannot
        self._failed_steps = 0  # in a row
        self._next_index = 0
        self._uids = itertools.count()
        self._embedders: dict[Pooling, Embedder] = {}  # made on first use, one per pooling type
        self._default_pooling: Pooling | None = None

    def _checkpoint_every(self) -> int | None:
        """Prompt tokens between checkpoints (0: at prompt ends and parting points only; None:
        none, the memory can be cut anywhere). A sliding window's checkpoint holds the whole
        window (15 MiB for Gemma 3 270M), so those are taken only where they are known to pay."""
        if not self.memory.checkpointing:
            return None
        return 0 if self.memory.caps.family is Family.SLIDING_WINDOW else self.config.checkpoint_every

    def _prompt_cache(self, path: Path) -> PromptCache | None:
        cfg = self.config
        if not cfg.cache_ram and not cfg.cache_dir:
            return None
        key = fingerprint(path, [spec.path for spec, _ in self.adapters.chosen], cfg.cache_type_k, cfg.cache_type_v, str(self.ctx.flash_attn))
        return PromptCache(cfg.cache_ram, key, None if cfg.cache_dir is None else Path(cfg.cache_dir), cfg.cache_disk)

    def _chat(self, builtin: str | None) -> Chat | None:
        """The model's chat format: --chat-template over the GGUF's template over the catalog's
        built-in (for GGUFs without one); None when there is no template at all. A template the
        user named that cannot be read, parsed or found is refused here, not on every request."""
        vocab, override = self.model.vocab, self.config.chat_template
        try:
            template = ChatTemplate.choose(override, self.model.chat_template_text(), builtin,
                                           bos=vocab.text(vocab.bos) or "", eos=vocab.text(vocab.eos) or "")
            if template is None:
                return None
            chat = Chat(template, vocab, lambda messages: self.model.apply_builtin_template(messages, template.source))
            if override is not None:
                chat.check()
        except (ChatTemplateError, ModelError) as e:
            raise ConfigError(f"--chat-template {override}: {e}" if override else str(e)) from None
        return chat

    def _rollback_snapshots(self) -> int:
        """Speculation on recurrent or hybrid memory: ask llama.cpp to keep the states after each of
        a decode's last draft_max tokens, so rejected drafts roll back without a checkpoint (where
        the architecture supports it; elsewhere llama.cpp grants none and checkpoints do it)."""
        cfg = self.config
        if cfg.speculative == "off" or not (self.model.is_recurrent or self.model.is_hybrid):
            return 0
        return cfg.draft_max

    def _placement(self) -> dict:
        """Where the model's offloaded layers go: with --rpc, the remotes' devices, then this
        host's GPUs (llama.cpp's order), each taking its --tensor-split share."""
        cfg = self.config
        if not cfg.rpc:
            return dict(tensor_split=cfg.tensor_split)
        devices = remote_devices(cfg.rpc) + local_accelerators()
        rpc_guard.exit_when_lost(cfg.rpc, cfg.rpc_timeout or RPC_TIMEOUT_S)  # from here, a remote gone is an exit, not an abort or a hang
        return dict(devices=devices, tensor_split=cfg.tensor_split)

    # -- submitting work -------------------------------------------------------------

    def add(
        self, prompt: str | list[int], params: SamplingParams | None = None, index: int | None = None,
        *, score_from: int | None = None, priority: int = 0, priority_class: str = "interactive",
    ) -> list[Sequence]:
        """Queue a prompt (text, or token ids) for params.n samples, which share its KV. With
        score_from (or params.prompt_logprobs, which scores from the second token), the prompt's
        tokens from that index on get their log-probabilities as it is decoded. A lower priority
        runs first (scheduler.rank), preempting worse-ranked sequences when no slot is free.
        Raises PromptError (or SamplingError, ConstraintError) when it cannot run; nothing is
        queued then."""
        params = params or SamplingParams()
        if index is None:
            index, self._next_index = self._next_index, self._next_index + 1
        if len(prompt) == 0:
            raise PromptError("empty prompt")
        if isinstance(prompt, str):
            tokens = self.tokenize_prompt(prompt)
        else:
            tokens = [int(t) for t in prompt]
            prompt = self.vocab.detokenize(tokens)  # refuses ids outside the vocabulary
        if len(tokens) > self.ctx.n_ctx_seq:
            hint = "raise --ctx" if self.ctx.kv_unified else "raise --ctx or lower --parallel"
            raise PromptError(
                f"prompt is {len(tokens)} tokens, longer than the {self.ctx.n_ctx_seq}-token context of one sequence ({hint})"
            )
        if score_from is None and params.prompt_logprobs is not None and len(tokens) > 1:
            score_from = 1  # a one-token prompt has nothing to score: its only entry is the null
        if score_from is not None and not 1 <= score_from < len(tokens):
            raise PromptError(f"nothing to score: tokens from {score_from} on of a {len(tokens)}-token prompt")
        if params.logit_bias and params.logit_bias[-1][0] >= self.vocab.n_vocab:  # sorted: the largest id last
            raise SamplingError(f"logit_bias: token {params.logit_bias[-1][0]} is outside the vocabulary (0..{self.vocab.n_vocab - 1})")
        constraint = Constraint.of(params)
        matchers = [self.grammars.matcher(constraint) for _ in range(params.n)] if constraint else [None] * params.n
        adapters = self.adapters.default if params.adapters is None else params.adapters
        self.adapters.check(adapters)
        sequences = [self._new_sequence(index, k, prompt, tokens, p) for k, p in enumerate(params.per_sample())]
        if params.n > self.config.n_parallel and self.scheduler.checkpoint_every is not None:
            for seq in sequences:  # samples that wait for a slot take the prompt from a checkpoint there
                seq.checkpoint_at = len(tokens) - 1
        budget = params.thinking_budget
        close = self.vocab.tokenize(f"\n{budget.close}\n\n", add_special=False) if budget else None
        for seq, matcher, p in zip(sequences, matchers, params.per_sample()):
            seq.matcher, seq.adapters = matcher, adapters
            seq.thought = Thought(budget, close) if budget else None
            seq.special = matcher is not None or p.logprobs is not None or p.max_tokens == 0 or budget is not None
            seq.priority, seq.priority_class = priority, priority_class
            seq.score_from = -1 if score_from is None else score_from
            if params.max_tokens == 0 and score_from is None:  # nothing to generate, nothing to score: done
                seq.status, seq.finish_reason = Status.FINISHED, "length"
            else:
                self.scheduler.add(seq)
        return sequences

    def _new_sequence(self, index: int, sample: int, prompt: str, tokens: list[int], params: SamplingParams) -> Sequence:
        sampler = build_sampler(params, self.ctx.n_ctx_seq, self.vocab, len(tokens))  # penalties look back over the prompt too, as llama.cpp's server does
        # max_tokens reached, or the context: the newest token is decoded at len(tokens) - 1 next step, in a cell it needs.
        max_len = min(len(tokens) + params.max_tokens, self.ctx.n_ctx_seq + 1)
        return Sequence(index, prompt, params, list(tokens), len(tokens), sampler=sampler, sample=sample, uid=next(self._uids),
                        max_len=max_len)

    def submit(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
        *, priority: int = 0, priority_class: str = "interactive",
    ) -> list[Sequence]:
        """Queue prompts (index = position in `prompts`); n samples each, in order. A prompt that
        cannot run comes back already finished with its error; the others are unaffected."""
        prompts = list(prompts)
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        else:
            params = [params or SamplingParams()] * len(prompts)
        return [seq for i, (p, sp) in enumerate(zip(prompts, params)) for seq in self._submit_one(i, p, sp, priority, priority_class)]

    def _submit_one(self, index: int, prompt: str | list[int], params: SamplingParams, priority: int, priority_class: str) -> list[Sequence]:
        try:
            return self.add(prompt, params, index, priority=priority, priority_class=priority_class)
        except (PromptError, SamplingError, ConstraintError) as e:
            prompt = prompt if isinstance(prompt, str) else ""
            return [
                Sequence(index, prompt, p, [], 0, sample=k, status=Status.FINISHED, finish_reason="error", error=str(e), refused=True)
                for k, p in enumerate(params.per_sample())
            ]

    def tokenize_prompt(self, prompt: str) -> list[int]:
        if self.config.chat:
            return self.chat_prompt([{"role": "user", "content": prompt}]).tokens
        return self.vocab.tokenize(prompt)

    def chat_prompt(
        self, messages: list[dict], tools: Tools | None = None, template_kwargs: dict | None = None, reasoning_budget: int = -1,
    ) -> ChatPrompt:
        """The prompt for chat messages with the model's template (Chat.prompt). Raises
        ChatTemplateError (a PromptError) for a model without one, or messages its template refuses."""
        if self.chat is None:
            raise ChatTemplateError(f"{self.model.path.name} has no chat template (give --chat-template, set chat_template in models.toml, or drop --chat)")
        return self.chat.prompt(messages, tools, template_kwargs, reasoning_budget)

    # -- running -----------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[Event]:
        """Admit, schedule, fill one batch, decode it once, sample each sequence that is due a token.
        A decode that fails because of one sequence fails that sequence alone (_run); anything
        else that fails a step fails the sequences it carried. Once MAX_FAILED_STEPS in a row
        decode nothing, the engine is broken and every later step raises EngineBroken."""
        if self.broken is not None:
            raise EngineBroken(self.broken)
        events: list[Event] = []
        carried: list[Sequence] = []
        try:
            failure = self._step(events, carried)
        except Exception as e:  # noqa: BLE001 - whatever failed, the sequences must end, reported
            events += self._fail_step(carried or list(self.scheduler.running), e)
        else:
            if failure is None:
                self._failed_steps = 0
            else:
                self._count_failed_step(failure)
        return events

    def _step(self, events: list[Event], carried: list[Sequence]) -> str | None:
        """One step; returns why it decoded nothing, when every row it carried failed to decode."""
        started = time.perf_counter()
        for victim in self.scheduler.victims():
            self._make_way(victim)
        for seq in self.scheduler.admit():
            self._resume(seq)
            self.stats.prompt_tokens_reused += seq.n_cached
        drafted = self._propose_drafts() if self.speculator is not None else None  # None: nothing planned
        scheduled = self.scheduler.schedule(reserved=sum(len(s.draft) for s in drafted) if drafted else 0)
        carried += scheduled
        for seq in drafted or ():
            seq.n_chunk += len(seq.draft)  # its last token, then the drafts
            self.memory.prepare_to_reject(seq.seq_id, len(seq.draft))
        if not scheduled:
            return None
        if self.adapters.apply(self.ctx, scheduled[0].adapters):  # the scheduler gives a step one set
            self.stats.adapter_switches += 1
        tokens_before = self.stats.completion_tokens
        decoded, failure = self._run(scheduled, events)
        ended = time.perf_counter()
        if decoded:
            self.stats.record_step(started, ended)
        if drafted is not None and failure is None:  # planned, so a pure decode step (the speculator plans none beside a prompt)
            self.speculator.observe(drafted, self.stats.completion_tokens - tokens_before, ended - started)
        return failure if not decoded else None

    def _run(self, rows: list[Sequence], events: list[Event]) -> tuple[int, str | None]:
        """Decode the rows in one batch, then advance and sample them. A full KV cache is
        recovered from; any other failed decode is tried again in halves, down to the sequence it
        fails for, which fails alone with llama.cpp's reason: the others decode as they would have.
        Returns how many rows were decoded, and the last failure (None: none)."""
        try:
            self._decode(rows)
        except DecodeError as e:
            if e.code == KV_FULL:
                events += self._recover_kv_full(rows)
                return 0, None
            self._undo(rows, stored=e.code != INVALID_BATCH)
            self.stats.failed_decodes += 1
            named = self._named_by(e)
            if named is not None or len(rows) == 1:
                events.append(self._fail(named or rows[0], str(e)))
                rest = [seq for seq in rows if seq.status is Status.RUNNING]
                decoded, _ = self._run(rest, events) if rest else (0, None)
                return decoded, str(e)
            decoded, failure = 0, None
            for part in (rows[: len(rows) // 2], rows[len(rows) // 2 :]):
                part = [seq for seq in part if seq.status is Status.RUNNING]  # a half may have preempted some
                n, why = self._run(part, events) if part else (0, None)
                decoded, failure = decoded + n, why or failure
            return decoded, failure
        logits = self.ctx.output_logits(self.batch.n_outputs, self.vocab.n_vocab) if self.batch.n_outputs else None
        if self.scheduler.decodes_only:  # the plain step: each row took its token in and samples the next
            for seq in rows:
                seq.n_past += 1
            self._sample(rows, range(len(rows)), logits, events)
            return len(rows), None
        due: list[Sequence] = []
        for seq in rows:
            self._advance(seq, due, logits)
        if due:
            self._sample(due, [self._output_row[s.i_batch] for s in due], logits, events)
        return len(rows), None

    def _named_by(self, error: DecodeError) -> Sequence | None:
        """The running sequence llama.cpp's refusal names ("the tokens of sequence 3 ..."), if any:
        it fails at once, with no halving (which a filler in its stream would mislead)."""
        found = re.search(r"\bsequence (\d+)\b", str(error))
        return next((seq for seq in self.scheduler.running if found and seq.seq_id == int(found[1])), None)

    def _undo(self, rows: list[Sequence], stored: bool = True) -> None:
        """A decode that did not go through: drafts are dropped (the rows decode their last token),
        and where llama.cpp may have stored part of the batch (`stored`: it failed while
        computing, after some micro-batches), each row's memory goes back to what it held before,
        which recurrent memory may only do to a checkpoint (those rows then prefill from there).
        A batch refused whole (no free KV slot, or invalid) left memory as it was."""
        for seq in rows:
            if seq.draft:
                seq.n_chunk -= len(seq.draft)
                seq.draft = []
            if stored:
                seq.n_past = self.memory.truncate(seq.seq_id, seq.n_past)

    def _count_failed_step(self, why: str) -> None:
        self._failed_steps += 1
        self.stats.failed_steps += 1
        if self._failed_steps >= MAX_FAILED_STEPS:
            self.broken = f"{MAX_FAILED_STEPS} engine steps failed in a row, the last with: {why}"

    def _fail_step(self, carried: list[Sequence], error: Exception) -> list[Event]:
        """End every unfinished sequence the failed step carried with the error (their events
        from before the failure stand), and any follower it gave a prefix to that never got to
        sample from it (nothing left to decode, it would wait forever)."""
        message = f"the engine step failed: {type(error).__name__}: {error}"
        self._count_failed_step(message)
        stranded = [seq for seq in self.scheduler.running if seq.n_pending == 0]
        return [self._fail(seq, message) for seq in dict.fromkeys(carried + stranded) if seq.status is not Status.FINISHED]

    def run(self) -> Iterator[Event]:
        """Step until every queued sequence has finished, yielding each step's events."""
        while self.has_work:
            yield from self.step()

    def generate(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Result]:
        """Run prompts to completion; results in input order (n per prompt when params.n > 1).
        A bad prompt fails only its own results."""
        sequences = self.submit(prompts, params)
        for _ in self.run():
            pass
        return [seq.result() for seq in sequences]

    def score(self, items: Iterable[str | tuple[str, str]], *, bos: bool = True, chunk: int | None = None) -> list[Score]:
        """Log-probabilities of texts (every token after the first) or of continuations after
        their contexts, many per llama_decode, with logits only at the scored positions.
        With chunk, a text is cut into chunk-token windows, each starting with BOS and scored on
        its second half, as llama.cpp's llama-perplexity does. Results in input order; an item
        that cannot be scored fails alone."""
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
        for _ in self.run():
            pass
        return [
            Score(i, 0.0, 0, False, errors[i]) if i in errors else total_score(i, sequences[i])
            for i in range(len(sequences) + len(errors))
        ]

    def stream(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> Iterator[Event]:
        """Run prompts, yielding each token's event as it is sampled (Event.index is the input position)."""
        for seq in self.submit(prompts, params):
            if seq.status is Status.FINISHED:  # refused, or nothing to do (max_tokens 0)
                yield self._event(seq, None, "", seq.finish_reason, seq.error)
        yield from self.run()

    def cancel(self, seq: Sequence) -> Event | None:
        """Stop a sequence now (its client went away): a queued one leaves the queue, a running
        one frees its slot at once. Returns its last event, or None if it had already finished."""
        if seq.status is Status.FINISHED:
            return None
        return self._finish(seq, None, "", "cancelled")

    # -- embeddings --------------------------------------------------------------------

    def embedder(self, pooling: str | Pooling | None = None) -> Embedder:
        """The embedding context for `pooling` (by default the GGUF's, else mean), made on first
        use beside the generation context, on the same weights."""
        if pooling is None:  # read from the GGUF once: a job asks for every line
            pooling = self._default_pooling = self._default_pooling or model_pooling(self.model) or Pooling.MEAN
        chosen = Pooling(pooling)
        embedder = self._embedders.get(chosen)
        if embedder is None:
            cfg = self.config
            # Deterministic: each text decoded alone, so its vector does not depend on the others.
            embedder = self._embedders[chosen] = Embedder(
                self.model, chosen, n_threads=cfg.n_threads, pack_tokens=cfg.embed_pack,
                max_texts=1 if cfg.deterministic else MAX_TEXTS_PER_DECODE,
            )
            self.adapters.attach(embedder.ctx, self.adapters.default)  # the vectors of the model generation uses
        return embedder

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

    def reset_stats(self) -> None:
        self.stats = RunStats()

    def drop_cached_prefixes(self) -> None:
        """Free the KV that finished sequences left in their slots for later prompts."""
        for seq_id in self.scheduler.evict_cached():
            self.memory.clear(seq_id)

    # -- the prompt cache --------------------------------------------------------------

    def _resume(self, seq: Sequence) -> None:
        """Give an admitted sequence its memory (memory.resume): what its slot keeps of the
        prefix the scheduler matched, or more of its prompt from the prompt cache. Whatever the
        slot held that the sequence does not keep goes to the prompt cache first."""
        cache = self.prompt_cache
        if cache is not None and seq.swapped is None:
            slot = self.scheduler.slot_of(seq)
            if seq.n_past < len(slot.cached):
                self._keep_prompt(seq.seq_id, slot.cached, slot.adapters)
            if seq.leader is None:  # (a leader, admitted before it, looked here already)
                self._restore_prompt(seq, cache)
        self.memory.resume(seq)

    def _keep_prompt(self, seq_id: int, tokens: list[int], adapters: AdapterSet) -> None:
        """The stream's memory (it holds exactly `tokens`) into the prompt cache."""
        cache = self.prompt_cache
        if len(tokens) < PROMPT_CACHE_MIN_TOKENS or cache.holds(tokens, adapters) or self.memory.held(seq_id) != len(tokens):
            return
        state, checkpoints = self.memory.snapshot(seq_id)
        if state:
            cache.keep(CachedPrompt.of(tokens, adapters, state, checkpoints))

    def _restore_prompt(self, seq: Sequence, cache: PromptCache) -> None:
        """Where a cached prompt gives more of this one than its slot does, it replaces the slot's
        memory, and seq.n_past becomes the prefix they share (memory.resume then cuts it there)."""
        limit = min(len(seq.tokens) - 1, seq.shareable)  # as the scheduler's match: the newest token is decoded again
        if limit < PROMPT_CACHE_MIN_TOKENS:
            return
        best, n_best = None, self.memory.reusable(seq.seq_id, seq.n_past) + PROMPT_CACHE_MIN_TOKENS - 1  # worth a restore
        for shared, entry in cache.candidates(seq.tokens[:limit], seq.adapters):
            n = self.memory.reusable_from(shared, entry.n_tokens, entry.positions)
            if n > n_best:
                best, n_best, seq.n_past = entry, n, shared
        if best is None:
            cache.stats.misses += 1
            return
        loaded = cache.load(best)
        held = self.memory.put_back(seq.seq_id, *loaded) if loaded is not None else 0
        if held != best.n_tokens:
            if loaded is not None:
                cache.refuse(best, "llama.cpp did not take its state")
            self.memory.clear(seq.seq_id)
            seq.n_past = 0

    def _keep_free_slots(self) -> None:
        """Every free slot's cached prompt into the prompt cache (before the slots lose them)."""
        if self.prompt_cache is not None:
            for slot in self.scheduler.cached_slots():
                self._keep_prompt(slot.seq_id, slot.cached, slot.adapters)

    # -- inside a step ---------------------------------------------------------------

    def _propose_drafts(self) -> list[Sequence] | None:
        """Drafts where the speculator plans them; their rows must fit the batch beside every
        decode row, their logits the logits budget."""
        running = self.scheduler.running
        room = min(self.ctx.n_batch, self.scheduler.max_outputs) - len(running)
        return self.speculator.propose(running, room, self.ctx.n_ctx_seq)

    def _make_way(self, victim: Sequence) -> None:
        """Preempt a running sequence for a better-priority one: its memory swapped out to host
        memory where the budget holds it (put back when it runs again), else freed."""
        self.memory.swap_out(victim)
        victim.draft = []
        self.scheduler.preempt(victim, kv_full=False)
        self.stats.priority_preemptions += 1

    def _decode(self, scheduled: list[Sequence]) -> None:
        """One batch of the scheduled sequences' chunks (and deterministic fillers), one decode."""
        fillers = self.scheduler.fillers(scheduled) if self.config.deterministic else []
        for filler in fillers:
            self.memory.prepare_to_reject(filler.seq_id, 1)
        if self.scheduler.decodes_only:  # one token and one logits row each, row k for scheduled[k]
            self.batch.set(*lay_out_decodes(scheduled))
        else:
            # Rows in seq_id order: llama.cpp groups consecutive seq_ids into one micro-batch.
            rows = sorted([*scheduled, *fillers], key=lambda row: row.seq_id) if fillers else scheduled  # already in order
            tokens, pos, seq_ids, logits, self._output_row = lay_out(rows, self._filler_logits)
            self.batch.set(tokens, pos, seq_ids, logits)
        self.stats.decode_calls += 1
        self.stats.sequence_slots += len(scheduled)
        try:
            self.ctx.decode(self.batch)
        except DecodeError as e:
            if e.code not in (KV_FULL, INVALID_BATCH):  # refused whole, it stored nothing
                self._take_out(fillers)
            raise
        self._take_out(fillers)

    def _take_out(self, fillers: list[Filler]) -> None:
        """Each filler's stream goes back to what it held: its owner is a prompt between chunks or
        a slot's cached prefix, which the filler must not change."""
        for filler in fillers:
            if self.memory.reject(filler.seq_id, filler.pos, decoded=1) != filler.pos:
                raise MemoryRefused(f"a deterministic filler could not be taken out of sequence {filler.seq_id}'s memory")

    def _advance(self, seq: Sequence, due: list[Sequence], logits: np.ndarray | None) -> None:
        """The decode took the chunk into the KV cache: score the prompt tokens it predicts, hand
        the prefix to followers that wait for exactly this much of it; each sequence now due a
        token joins `due` (followers first)."""
        self.stats.prompt_tokens_evaluated += max(0, min(seq.n_chunk, seq.n_prompt - seq.n_past))
        scored = seq.scored_rows(seq.n_past, seq.n_chunk)
        if scored:
            first = self._output_row[seq.chunk_row + scored.start - seq.n_past]
            targets = seq.tokens[scored.start + 1 : scored.stop + 1]
            score_rows(seq.scored, logits[first : first + len(scored)], targets, seq.params.prompt_logprobs)
        seq.n_past += seq.n_chunk
        if seq.checkpoint_after:
            seq.checkpoint_after = False
            self.memory.checkpoint(seq.seq_id)
        if seq.followers:
            for follower in [f for f in seq.followers if f.n_shared == seq.n_past]:
                self._share_prefix(seq, follower, due)
        if seq.i_batch >= 0:
            due.append(seq)

    def _share_prefix(self, leader: Sequence, follower: Sequence, due: list[Sequence]) -> None:
        self.stats.prompt_tokens_reused += self.memory.share(leader, follower)
        leader.followers.remove(follower)
        follower.leader = None
        if follower.n_past == follower.n_shared and follower.n_pending == 0:  # the whole prompt is shared: sample from the leader's logits
            follower.i_batch = leader.i_batch
            due.append(follower)
        # The follower may have jumped past what its own followers wait for: they copy from it now.
        for waiting in [f for f in follower.followers if f.n_shared <= follower.n_past]:
            self._share_prefix(follower, waiting, due)

    def _sample(self, due: list[Sequence], rows: list[int] | range, logits: np.ndarray, events: list[Event]) -> None:
        """Each due sequence's next token from its row of this step's logits (rows[k] for due[k]):
        greedy ones from one argmax over all rows, the others by their own samplers
        (sampling.RowSampler); constrained ones after their rows are masked. A sequence that asked
        for no tokens (max_tokens 0: its prompt was only scored) ends here. Each event joins
        `events` as it happens."""
        # Followers sampling from their leader's row share it (never in a plain step: rows is a range).
        shared = set() if isinstance(rows, range) else {r for r, k in Counter(rows).items() if k > 1}
        raw = self._mask_constrained(due, rows, shared, logits)
        best = logits.argmax(axis=1).tolist() if any(s.sampler.greedy for s in due) else None
        for seq, r in zip(due, rows):
            try:
                if seq.special or seq.draft:
                    events += self._sample_special(seq, r, shared, best, raw, logits)
                elif seq.sampler.greedy:
                    events.append(self._accept(seq, best[r]))
                else:
                    events.append(self._accept(seq, seq.sampler.sample(logits[r], seq.tokens, self._scratch)))
            except Exception as e:  # noqa: BLE001 - its failure, not its neighbours'
                if seq.status is not Status.FINISHED:
                    events.append(self._fail(seq, f"sampling failed: {type(e).__name__}: {e}"))

    def _sample_special(self, seq: Sequence, r: int, shared: set[int], best: list[int] | None,
                        raw: dict[int, np.ndarray], logits: np.ndarray) -> list[Event]:
        if seq.params.max_tokens == 0:
            return [self._finish(seq, None, "", "length")]
        if seq.draft:
            return self._verify(seq, best, logits)
        if seq.forced:  # a thought closed for it: the close is written, whatever the row says
            token = seq.forced.pop(0)
        elif seq.matcher is not None and r in shared:
            token = self._sample_masked_copy(seq, logits[r])
        else:
            token = best[r] if seq.sampler.greedy else seq.sampler.sample(logits[r], seq.tokens, self._scratch)
        if seq.params.logprobs is not None:  # the model's own distribution, before any mask
            seq.logprobs.append(token_logprob(raw.get(seq.uid, logits[r]), token, seq.params.logprobs))
        return [self._accept(seq, token)]

    def _verify(self, seq: Sequence, best: list[int] | None, logits: np.ndarray) -> list[Event]:
        """Accept what the speculator keeps of the sequence's drafts (their rejected KV is
        forgotten), one token at a time, so EOS, stop strings and max_tokens cut the run exactly
        where a step each would have."""
        k = len(seq.draft)
        first = self._output_row[seq.chunk_row]
        picks, n_ok = self.speculator.verify(seq, None if best is None else best[first : first + k + 1], logits[first : first + k + 1],
                                             self._scratch)
        seq.draft = []
        seq.n_past -= k - n_ok  # the decode took all k + 1 tokens in; the rejected ones go
        if n_ok < k:
            # Recurrent memory may go back further, to its checkpoint: the kept tokens are decoded again.
            seq.n_past = self.memory.reject(seq.seq_id, seq.n_past, decoded=k + 1)
        self.stats.draft_tokens += k
        self.stats.draft_accepted += n_ok
        events = []
        for j, token in enumerate(picks):
            if seq.params.logprobs is not None:
                seq.logprobs.append(token_logprob(logits[first + j], token, seq.params.logprobs))
            events.append(self._accept(seq, token))
            if events[-1].finish_reason is not None:
                break
        return events

    def _mask_constrained(self, due: list[Sequence], rows: list[int], shared: set[int], logits: np.ndarray) -> dict[int, np.ndarray]:
        """Mask, in place and together, the rows of constrained sequences that sample alone from
        them; returns unmasked copies of those whose log-probabilities are reported."""
        alone = [(seq, r) for seq, r in zip(due, rows) if seq.matcher is not None and r not in shared and seq.params.max_tokens]
        raw = {seq.uid: logits[r].copy() for seq, r in alone if seq.params.logprobs is not None}
        if alone:
            self.grammars.mask_rows([seq.matcher for seq, _ in alone], [logits[r] for _, r in alone])
        return raw

    def _sample_masked_copy(self, seq: Sequence, row: np.ndarray) -> int:
        """A constrained sequence sampling from a row others sample from too: mask it, sample, and
        put it back as it was for them."""
        original = row.copy()
        self.grammars.mask_rows([seq.matcher], [row])
        try:
            return int(row.argmax()) if seq.sampler.greedy else seq.sampler.sample(row, seq.tokens, self._scratch)
        finally:
            row[:] = original

    def _accept(self, seq: Sequence, token: int) -> Event:
        """Append the sampled token; finish the sequence if it ends here (a constrained one ends
        when its constraint is complete)."""
        seq.tokens.append(token)
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            # The mask allowed nothing it would take: the constraint itself broke down (llguidance
            # gave up on it, or it has a dead end), which is the request's to fix, as a schema
            # that does not compile is.
            seq.refused = True
            return self._finish(seq, token, "", "error", f"the constraint cannot be followed: {seq.matcher.get_error()}")
        self.stats.completion_tokens += 1
        if seq.t_first_token is None:
            seq.t_first_token = time.perf_counter()
        if self.vocab.is_eog(token) and not seq.params.ignore_eos:
            return self._finish(seq, token, "", "stop")
        text = seq.text.push(self.vocab.piece(token))
        if seq.thought is not None and not seq.forced:
            seq.forced = seq.thought.after(self.vocab.piece(token).decode(errors="replace")) or []
        if seq.text.stopped or (seq.matcher is not None and seq.matcher.is_stopped()):
            return self._finish(seq, token, text, "stop")
        if len(seq.tokens) >= seq.max_len:
            return self._finish(seq, token, text, "length")
        return Event(seq.index, token, text, None, None, seq.sample, seq.uid, seq.logprobs[-1] if seq.logprobs else None)

    def _finish(self, seq: Sequence, token: int | None, text: str, reason: str, error: str | None = None) -> Event:
        """The sequence is done; its KV stays in its slot as a prefix cache for later prompts
        (when prefixes are shared; else it is freed, so a deterministic filler finds room there)."""
        text += seq.text.finish()
        self.memory.drop_swap(seq)
        seq.finish_reason, seq.error = reason, error
        if seq.incomplete:
            self.stats.incomplete_structured += 1
        seq.t_finished = time.perf_counter()
        if seq.status is Status.RUNNING and not self.config.share_prefixes:
            self.memory.clear(seq.seq_id)
        self.scheduler.release(seq)
        seq.close_samplers()
        return self._event(seq, token, text, reason, error)

    @staticmethod
    def _event(seq: Sequence, token: int | None, text: str, reason: str | None = None, error: str | None = None) -> Event:
        logprob = seq.logprobs[-1] if token is not None and seq.logprobs else None
        return Event(seq.index, token, text, reason, error, seq.sample, seq.uid, logprob)

    def _recover_kv_full(self, scheduled: list[Sequence]) -> list[Event]:
        """No KV slot for this batch: undo it, then make room by dropping cached prefixes,
        preempting the newest sequence, or (alone) cutting it short."""
        self._undo(scheduled, stored=False)
        if self.ctx.kv_unified and self.scheduler.has_cached_prefixes:  # cells the batch can use: retry
            self._keep_free_slots()
            self.drop_cached_prefixes()
            return []
        if len(self.scheduler.running) > 1:
            victim = max(self.scheduler.running, key=self.scheduler.rank_of)  # the worst ranked: the newest of the lowest priority
            self.memory.clear(victim.seq_id)
            self.scheduler.preempt(victim)
            self.stats.preemptions += 1
            return []
        return [self._fail(self.scheduler.running[0], "KV cache full: the sequence does not fit even alone")]

    def _fail(self, seq: Sequence, message: str) -> Event:
        """End a sequence with the engine's error. Its KV goes: a failed decode may have left
        part of a batch there."""
        if seq.status is Status.RUNNING:
            self.memory.clear(seq.seq_id)
            seq.n_past = 0  # its slot keeps nothing
        seq.draft = []
        return self._finish(seq, None, "", "error", message)

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Free every native handle: samplers of unfinished sequences, batch, context, then model."""
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            seq.close_samplers()
        if self.prompt_cache is not None:
            if self.prompt_cache.folder is not None and self.broken is None:  # on disk, the slots' prompts outlive the process
                self._keep_free_slots()
            self.prompt_cache.close()
        if self.speculator is not None:
            self.speculator.close()
        for embedder in self._embedders.values():
            embedder.close()
        self.batch.close()
        self.ctx.close()
        self.adapters.close()  # before the model, which would free them itself
        self.model.close()
        if self.config.rpc:
            rpc_guard.exit_when_lost((), 0)

    def __enter__(self) -> BatchEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

