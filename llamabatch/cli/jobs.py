"""`batch` and `embed`: job files of any size, written as they finish, resumed when rerun."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import display
from ..engine import BatchEngine, SamplingParams
from ..engine.sizing.options import AUTO, EngineOptions
from ..errors import LlamabatchError
from .options import BadWordsOpt, DryAllowedLengthOpt, DryBaseOpt, DryMultiplierOpt, DryPenaltyLastNOpt, DrySequenceBreakersOpt, DynatempExponentOpt, DynatempRangeOpt, MinTokensOpt, MirostatEtaOpt, MirostatOpt, MirostatTauOpt, TopNSigmaOpt, TypicalPOpt, XtcProbabilityOpt, XtcThresholdOpt, further_samplers, BatchOpt, CacheTypeKOpt, CacheTypeVOpt, CatalogOpt, ChatOpt, ChatTemplateOpt, MmprojOffloadOpt, MmprojOpt, CheckpointEveryOpt, CheckpointMemoryOpt, StepTargetOpt, OverlapOpt, CacheRamOpt, CacheDirOpt, CacheDiskOpt, ChoiceOpt, CtxOpt, CtxPerSeqOpt, DeterministicOpt, DraftMaxOpt, DraftModelOpt, EmbedPackOpt, FlashAttnOpt, FrequencyPenaltyOpt, GpuLayersOpt, GrammarOpt, IgnoreEosOpt, JsonSchemaOpt, KvUnifiedOpt, LoraOpt, MaxTokensOpt, MemoryOpt, MinPOpt, ModelOpt, ParallelOpt, PresencePenaltyOpt, RegexOpt, RepeatPenaltyOpt, ReplicasOpt, RpcOpt, RpcTimeoutOpt, SamplesOpt, SeedOpt, SharePrefixesOpt, SpeculativeOpt, StopOpt, TemperatureOpt, TensorSplitOpt, ThreadsOpt, TopKOpt, TopPOpt, UbatchOpt, VerboseOpt, command_line, constraint, parse_pooling, parse_replicas, reports_errors


@reports_errors
def batch(
    context: typer.Context,
    input: Annotated[str, typer.Argument(help="Requests: OpenAI batch lines, JSONL {\"prompt\", ...}, or one prompt a line; '-' = stdin; .gz read as is.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Results, one JSON line per request as it completes; resumed if it exists.")],
    errors: Annotated[Optional[Path], typer.Option("--errors", help="Failed requests (default: OUTPUT.errors.jsonl).")] = None,
    retry_errors: Annotated[bool, typer.Option("--retry-errors", help="Run the requests in the error file again.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start afresh instead of resuming.")] = False,
    estimate_only: Annotated[bool, typer.Option(
        "--estimate", help="Print the job's size and expected time (from llamabatch tune's measurement, made first when none is stored), and run nothing.",
    )] = False,
    incomplete_errors: Annotated[bool, typer.Option(
        "--incomplete-errors", help="Answers whose structured output was cut by --max-tokens go to the error file, not the output.",
    )] = False,
    model: ModelOpt = None,
    config: CatalogOpt = None,
    max_tokens: MaxTokensOpt = None,
    temperature: TemperatureOpt = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    min_p: MinPOpt = None,
    repeat_penalty: RepeatPenaltyOpt = None,
    presence_penalty: PresencePenaltyOpt = None,
    frequency_penalty: FrequencyPenaltyOpt = None,
    seed: SeedOpt = None,
    stop: StopOpt = None,
    ignore_eos: IgnoreEosOpt = None,
    n: SamplesOpt = None,
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
    embed_pack: EmbedPackOpt = None,
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
    ray: Annotated[Optional[str], typer.Option(
        "--ray", metavar="ADDRESS", help="Run on a Ray cluster: 'local' (a Ray instance on this machine), 'auto' (the running cluster) or ray://host:port.",
    )] = None,
    replicas: ReplicasOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the final summary as one JSON object.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Run a job file of any size: results stream to OUTPUT as they finish; a rerun resumes."""
    from ..jobs.batch_job import BatchJob, stop_on_signals
    from ..jobs.estimate import estimate
    from ..jobs.inputs import STDIN

    given = dict(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        seed=seed, stop=stop and tuple(stop), ignore_eos=ignore_eos, n=n, **constraint(json_schema, grammar, regex, choice),
        **further_samplers(context.params),
    )
    given = {k: v for k, v in given.items() if v is not None}
    base = SamplingParams(**given) if given else None
    if replicas is not None and ray is None:
        raise LlamabatchError("--replicas runs engines on Ray: add --ray local|auto|ADDRESS, or drop --replicas")
    if ray is not None and parallel == AUTO:
        raise LlamabatchError("--parallel auto plans for this machine's memory, not the Ray actors': give --parallel N")
    options = EngineOptions.of(context.params)
    engine_options = options.engine_kwargs()
    if estimate_only and (ray is not None or input == STDIN):
        raise LlamabatchError("--estimate reads the input file before the job: not with --ray or standard input")
    if ray is not None:
        summary, job = _batch_on_ray(ray, parse_replicas(replicas), engine_options, input, output, errors, base, retry_errors,
                                     overwrite, incomplete_errors)
        described = {"model": job.settings["model"], "replicas": replicas or "1", "ray": ray, **summary.to_dict()}
    else:
        tuned = options.tuning(engine_options["n_parallel"], say=display.note) if estimate_only else options.stored_tuning()
        with BatchEngine(**engine_options) as engine:
            guess = None if input == STDIN else estimate(engine, input, base, tuned)
            if estimate_only:
                assert guess is not None, "--estimate reads a file (refused above for standard input)"
                if json_out:
                    display.json_line({"estimate": guess.to_dict()})
                else:
                    display.job_estimate(guess)
                return
            if guess is not None:
                display.job_estimate(guess, brief=True)
            job = BatchJob(engine, input, output, errors=errors, base=base, retry_errors=retry_errors, overwrite=overwrite,
                           incomplete_errors=incomplete_errors)
            job.summary.estimated_s = None if guess is None else guess.seconds
            with stop_on_signals(job), display.BatchProgress(job.summary) as progress:
                job.on_progress = progress.update
                summary = job.run()
        described = {"model": engine.model_name, "parallel": engine.config.n_parallel, **summary.to_dict()}
    _report_job(context, job, summary, described, json_out, display.batch_summary)


def _report_job(context: typer.Context, job, summary, described: dict, json_out: bool, table) -> None:
    """A job's summary (a table, or one JSON line: `described` then the counts), then its exit: 1
    when the engine broke or a line failed, 130/143 when a signal stopped it, each with how to resume."""
    if json_out:
        display.json_line({"summary": described})
    else:
        table(summary, job.output, job.errors)
    if summary.broken:
        display.error_line(
            f"the job stopped: {summary.broken}. What finished is written; once the cause is fixed, resume "
            f"(and retry the failed requests) with: {command_line(context, drop={'overwrite', 'retry_errors'})} --retry-errors"
        )
        raise typer.Exit(1)
    if not summary.complete:
        display.error_line(
            f"stopped by {summary.stopped_by}: {summary.done} requests done in this run; "
            f"resume with: {command_line(context, drop={'overwrite'})}"
        )
        raise typer.Exit(130 if summary.stopped_by == "SIGINT" else 143)
    if summary.failed:
        display.error_line(f"{summary.failed} requests failed: see {job.errors}")
        raise typer.Exit(1)


@reports_errors
def embed(
    context: typer.Context,
    input: Annotated[str, typer.Argument(help="Texts: one a line, JSONL {\"input\", ...}, or OpenAI batch lines for /v1/embeddings; '-' = stdin; .gz read as is.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Vectors: .jsonl (a line per text), .parquet (a folder of parts) or .npy (rows in input order, OUTPUT.ids.txt beside it); resumed if it exists.")],
    errors: Annotated[Optional[Path], typer.Option("--errors", help="Failed lines (default: OUTPUT.errors.jsonl).")] = None,
    retry_errors: Annotated[bool, typer.Option("--retry-errors", help="Embed the lines in the error file again.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start afresh instead of resuming.")] = False,
    pooling: Annotated[Optional[str], typer.Option(help="mean, cls, last, or none: a vector per token, .jsonl only (default: the GGUF's, else mean).")] = None,
    normalize: Annotated[bool, typer.Option("--normalize/--no-normalize", help="Unit-length vectors.")] = True,
    dimensions: Annotated[Optional[int], typer.Option(help="Keep the first N dimensions (Matryoshka models), then normalize.")] = None,
    truncate: Annotated[bool, typer.Option("--truncate", help="Cut texts longer than an embedding takes instead of failing them.")] = False,
    embed_pack: EmbedPackOpt = None,
    deterministic: DeterministicOpt = None,
    model: ModelOpt = None,
    config: CatalogOpt = None,
    threads: ThreadsOpt = None,
    gpu_layers: GpuLayersOpt = None,
    rpc: RpcOpt = None,
    tensor_split: TensorSplitOpt = None,
    rpc_timeout: RpcTimeoutOpt = None,
    lora: LoraOpt = None,
    cache_type_k: CacheTypeKOpt = None,
    cache_type_v: CacheTypeVOpt = None,
    flash_attn: FlashAttnOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the final summary as one JSON object.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Embed a file of texts of any size, many texts a decode; a rerun resumes."""
    from ..embeddings_format import EmbedSettings
    from ..jobs.batch_job import BatchJob, stop_on_signals

    settings = EmbedSettings(parse_pooling(pooling, per_token=True), normalize, dimensions, truncate)
    # The generation context is not used: one small slot.
    engine_options = {**EngineOptions.of(context.params).engine_kwargs(), "n_parallel": 1, "n_ctx": 256}
    with BatchEngine(**engine_options) as engine:
        job = BatchJob(engine, input, output, errors=errors, retry_errors=retry_errors, overwrite=overwrite, embed=settings)
        with stop_on_signals(job), display.BatchProgress(job.summary, tokens="embedded") as progress:
            job.on_progress = progress.update
            summary = job.run()
        described = {"model": engine.model_name, "pooling": engine.embedder(settings.pooling).pooling.value, **summary.embed_dict()}
    _report_job(context, job, summary, described, json_out, display.embed_summary)


def _batch_on_ray(
    address: str, replicas: int | str, engine_options: dict, input: str, output: Path, errors: Path | None,
    base: SamplingParams | None, retry_errors: bool, overwrite: bool, incomplete_errors: bool,
):
    try:
        from ..jobs import ray_stage
    except ImportError as e:
        raise LlamabatchError(f"--ray needs Ray: pip install 'llamabatch[ray]' ({e})") from None
    from ..jobs.batch_job import stop_on_signals

    threads = engine_options.pop("n_threads")
    job = ray_stage.RayBatchJob(engine_options, input, output, address=address, replicas=replicas, threads=threads, errors=errors,
                                base=base, retry_errors=retry_errors, overwrite=overwrite, incomplete_errors=incomplete_errors)
    with stop_on_signals(job), display.BatchProgress(job.summary) as progress:
        job.on_progress = progress.update
        return job.run(), job
