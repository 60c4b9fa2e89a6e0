"""`run` and `score`: prompts generated or scored in one batch, results to the terminal."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import display
from ..engine import BatchEngine, MediaPrompt, Result, SamplingParams, Sequence
from ..engine.sizing.options import EngineOptions
from ..errors import LlamabatchError
from ..jobs.prompts import gather_prompts
from .options import BadWordsOpt, DryAllowedLengthOpt, DryBaseOpt, DryMultiplierOpt, DryPenaltyLastNOpt, DrySequenceBreakersOpt, DynatempExponentOpt, DynatempRangeOpt, MinTokensOpt, MirostatEtaOpt, MirostatOpt, MirostatTauOpt, TopNSigmaOpt, TypicalPOpt, XtcProbabilityOpt, XtcThresholdOpt, further_samplers, BatchOpt, CacheTypeKOpt, CacheTypeVOpt, CatalogOpt, ChatOpt, ChatTemplateOpt, MmprojOffloadOpt, MmprojOpt, CheckpointEveryOpt, CheckpointMemoryOpt, StepTargetOpt, OverlapOpt, CacheRamOpt, CacheDirOpt, CacheDiskOpt, ChoiceOpt, CtxOpt, CtxPerSeqOpt, DEFAULT, DeterministicOpt, DraftMaxOpt, DraftModelOpt, FlashAttnOpt, FrequencyPenaltyOpt, GpuLayersOpt, GrammarOpt, IgnoreEosOpt, JsonOpt, JsonSchemaOpt, KvUnifiedOpt, LoraOpt, MaxTokensOpt, MemoryOpt, MinPOpt, ModelOpt, ParallelOpt, PresencePenaltyOpt, RegexOpt, RepeatPenaltyOpt, RpcOpt, RpcTimeoutOpt, SamplesOpt, SeedOpt, SharePrefixesOpt, SpeculativeOpt, StopOpt, TemperatureOpt, TensorSplitOpt, ThreadsOpt, TopKOpt, TopPOpt, UbatchOpt, VerboseOpt, constraint, reports_errors


@reports_errors
def run(
    context: typer.Context,
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="A prompt (repeatable).")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option(help="Prompts: one per line, or JSONL objects with 'prompt' and sampling fields.")] = None,
    image: Annotated[Optional[list[Path]], typer.Option("--image", help="An image file (repeatable): one shown with every prompt, or one per prompt. Needs --mmproj.")] = None,
    audio: Annotated[Optional[list[Path]], typer.Option("--audio", help="An audio file, WAV, MP3 or FLAC (repeatable): one played with every prompt, or one per prompt. Needs an --mmproj that takes audio.")] = None,
    model: ModelOpt = None,
    config: CatalogOpt = None,
    max_tokens: MaxTokensOpt = DEFAULT.max_tokens,
    temperature: TemperatureOpt = DEFAULT.temperature,
    top_k: TopKOpt = DEFAULT.top_k,
    top_p: TopPOpt = DEFAULT.top_p,
    min_p: MinPOpt = DEFAULT.min_p,
    repeat_penalty: RepeatPenaltyOpt = DEFAULT.repeat_penalty,
    presence_penalty: PresencePenaltyOpt = DEFAULT.presence_penalty,
    frequency_penalty: FrequencyPenaltyOpt = DEFAULT.frequency_penalty,
    seed: SeedOpt = None,
    stop: StopOpt = None,
    ignore_eos: IgnoreEosOpt = False,
    n: SamplesOpt = 1,
    json_schema: JsonSchemaOpt = None,
    grammar: GrammarOpt = None,
    regex: RegexOpt = None,
    choice: ChoiceOpt = None,
    parallel: ParallelOpt = None,
    ctx: CtxOpt = None,
    ctx_per_seq: CtxPerSeqOpt = None,
    memory: MemoryOpt = None,
    n_batch: BatchOpt = None,
    n_ubatch: UbatchOpt = None,
    threads: ThreadsOpt = None,
    gpu_layers: GpuLayersOpt = None,
    rpc: RpcOpt = None,
    tensor_split: TensorSplitOpt = None,
    rpc_timeout: RpcTimeoutOpt = None,
    lora: LoraOpt = None,
    cache_type_k: CacheTypeKOpt = None,
    cache_type_v: CacheTypeVOpt = None,
    flash_attn: FlashAttnOpt = None,
    kv_unified: KvUnifiedOpt = None,
    share_prefixes: SharePrefixesOpt = None,
    deterministic: DeterministicOpt = None,
    speculative: SpeculativeOpt = None,
    draft_model: DraftModelOpt = None,
    draft_max: DraftMaxOpt = None,
    step_target: StepTargetOpt = None,
    overlap: OverlapOpt = None,
    checkpoint_every: CheckpointEveryOpt = None,
    checkpoint_memory: CheckpointMemoryOpt = None,
    cache_ram: CacheRamOpt = None,
    cache_dir: CacheDirOpt = None,
    cache_disk: CacheDiskOpt = None,
    dry_multiplier: DryMultiplierOpt = None,
    dry_base: DryBaseOpt = None,
    dry_allowed_length: DryAllowedLengthOpt = None,
    dry_penalty_last_n: DryPenaltyLastNOpt = None,
    dry_sequence_breaker: DrySequenceBreakersOpt = None,
    xtc_probability: XtcProbabilityOpt = None,
    xtc_threshold: XtcThresholdOpt = None,
    mirostat: MirostatOpt = None,
    mirostat_tau: MirostatTauOpt = None,
    mirostat_eta: MirostatEtaOpt = None,
    typical_p: TypicalPOpt = None,
    top_n_sigma: TopNSigmaOpt = None,
    dynatemp_range: DynatempRangeOpt = None,
    dynatemp_exponent: DynatempExponentOpt = None,
    min_tokens: MinTokensOpt = None,
    bad_word: BadWordsOpt = None,
    chat: ChatOpt = None,
    chat_template: ChatTemplateOpt = None,
    mmproj: MmprojOpt = None,
    mmproj_offload: MmprojOffloadOpt = None,
    stream: Annotated[bool, typer.Option(help="Show each sequence's text live.")] = False,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Generate completions for many prompts, decoded together in one batch."""
    base = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        seed=seed, stop=tuple(stop or ()), ignore_eos=ignore_eos, n=n,
        **constraint(json_schema, grammar, regex, choice), **further_samplers(context.params),
    )
    prompts, params = gather_prompts(prompt or [], prompts_file, base)
    if image or audio:
        prompts = _with_media(prompts, {"--image": image or [], "--audio": audio or []})
    with BatchEngine(**EngineOptions.of(context.params).engine_kwargs(n_sequences=sum(p.n for p in params))) as engine:
        live = stream and not json_out
        sequences = engine.submit(prompts, params, streamed=live)
        _drive(engine, sequences, live=live)
        results = [seq.result() for seq in sequences]
        stats = {"model": engine.model_name, "parallel": engine.config.n_parallel, **engine.stats.summary()}
        if engine.config.mmproj:
            stats["media_encoded"] = engine.media_encoded
    _report(results, stats, json_out=json_out, streamed=stream)
    if any(r.error for r in results):
        raise typer.Exit(1)


def _with_media(prompts: list[str | MediaPrompt], files: dict[str, list[Path]]) -> list[MediaPrompt]:
    """--image and --audio: each one file shown with every prompt, or one per prompt, in order (a
    prompt's image before its clip)."""
    if any(isinstance(p, MediaPrompt) for p in prompts):
        raise LlamabatchError("--image or --audio with a prompts file whose lines name their images: give one or the other")
    media: list[list[bytes]] = [[] for _ in prompts]
    for option, paths in files.items():
        if paths and len(paths) not in (1, len(prompts)):
            raise LlamabatchError(f"{option}: give one file (shown with every prompt) or one per prompt ({len(prompts)} prompts, {len(paths)} files)")
        for path in paths:
            if not path.is_file():
                raise LlamabatchError(f"{option}: file not found: {path}")
        data = [path.read_bytes() for path in paths]
        for k, shown in enumerate(media):
            shown += data[:1] if len(data) == 1 else data[k : k + 1]
    return [MediaPrompt(str(text), tuple(shown)) for text, shown in zip(prompts, media)]


def _drive(engine: BatchEngine, sequences: list[Sequence], live: bool) -> None:
    """Step the engine to the end, showing live text or a progress bar on the way."""
    if live:
        with display.StreamView(sequences) as view:
            while engine.has_work:
                view.update(engine.step())
        return
    done = sum(s.finish_reason is not None for s in sequences)
    with display.Steps("generating", len(sequences)) as steps:
        while engine.has_work:
            finished = sum(e.finish_reason is not None for e in engine.step())
            if finished:
                done += finished
                steps.update(done)


def _report(results: list[Result], stats: dict, json_out: bool, streamed: bool) -> None:
    if json_out:
        for result in results:
            display.json_line(_result_json(result))
        display.json_line({"summary": stats})
        return
    if not streamed:  # the live view already printed each completion
        for result in results:
            display.completion(result)
    display.summary(stats)


def _result_json(result: Result) -> dict:
    data = result.to_dict()
    data.pop("token_ids")
    data.pop("n_samples")
    if data["error"] is None:
        data.pop("error")
    return data


@reports_errors
def score(
    context: typer.Context,
    items: Annotated[Optional[Path], typer.Argument(help='JSON Lines: {"context", "continuation"} pairs or {"text"} texts.')] = None,
    text: Annotated[Optional[Path], typer.Option("--text", help="Score this whole file as one text instead.")] = None,
    chunk: Annotated[Optional[int], typer.Option(help="Score texts in windows of N tokens, BOS first, second half scored (llama-perplexity's way).")] = None,
    bos: Annotated[bool, typer.Option("--bos/--no-bos", help="Start every text and context with the BOS token.")] = True,
    model: ModelOpt = None,
    config: CatalogOpt = None,
    parallel: ParallelOpt = None,
    ctx: CtxOpt = None,
    ctx_per_seq: CtxPerSeqOpt = None,
    memory: MemoryOpt = None,
    n_batch: BatchOpt = None,
    n_ubatch: UbatchOpt = None,
    threads: ThreadsOpt = None,
    gpu_layers: GpuLayersOpt = None,
    rpc: RpcOpt = None,
    tensor_split: TensorSplitOpt = None,
    rpc_timeout: RpcTimeoutOpt = None,
    lora: LoraOpt = None,
    cache_type_k: CacheTypeKOpt = None,
    cache_type_v: CacheTypeVOpt = None,
    flash_attn: FlashAttnOpt = None,
    checkpoint_every: CheckpointEveryOpt = None,
    checkpoint_memory: CheckpointMemoryOpt = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Log-likelihoods and perplexity: each continuation given its context, or whole texts."""
    from ..jobs.prompts import read_score_items

    if (items is None) == (text is None):
        raise LlamabatchError("give ITEMS (a JSON Lines file) or --text FILE, not both")
    if text is not None and not text.is_file():
        raise LlamabatchError(f"text file not found: {text}")
    if chunk is not None and chunk < 4:
        raise LlamabatchError(f"--chunk must be at least 4 tokens, got {chunk}")
    scored = [text.read_text(errors="replace")] if text is not None else read_score_items(items)
    with BatchEngine(**EngineOptions.of(context.params).engine_kwargs(n_sequences=len(scored))) as engine:
        started = time.perf_counter()
        with display.Steps("scoring") as steps:
            scores = engine.score(scored, bos=bos, chunk=chunk, progress=steps.update)
        wall = time.perf_counter() - started
        evaluated = engine.stats.prompt_tokens_evaluated
    n_tokens = sum(s.n_tokens for s in scores)
    total = sum(s.logprob for s in scores)
    summary = {
        "model": engine.model_name, "items": len(scores), "failed": sum(s.error is not None for s in scores),
        "scored_tokens": n_tokens, "tokens_evaluated": evaluated, "greedy": sum(s.greedy for s in scores),
        "perplexity": round(math.exp(-total / n_tokens), 6) if n_tokens else None,
        "wall_s": round(wall, 3), "scored_tokens_per_s": round(n_tokens / wall, 2) if wall else None,
    }
    if json_out:
        for s in scores:
            display.json_line({k: v for k, v in s.to_dict().items() if v is not None or k != "error"})
        display.json_line({"summary": summary})
    else:
        display.score_table(scores)
        for s in scores:
            if s.error:
                display.error_line(f"item {s.index}: {s.error}")
        display.summary(summary)
    if any(s.error for s in scores):
        raise typer.Exit(1)
