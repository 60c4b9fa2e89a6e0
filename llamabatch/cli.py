"""The `llamabatch` command line: wiring only; the work happens in the engine, display in display."""

from __future__ import annotations

import functools
import json
import math
import os
import shlex
import signal
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from . import display
from .catalog import Catalog, ModelSpec
from .engine import BatchEngine, EngineConfig, Result, SamplingParams, Sequence
from .engine.memory import plan_for
from .engine.native import Model, init_backend
from .engine.options import AUTO, EngineOptions, memory_budget
from .engine.rpc import DEFAULT_PORT as DEFAULT_RPC_PORT
from .errors import LlamabatchError
from .jobs.prompts import gather_prompts
from .measure import sweep as sweep_bench

if TYPE_CHECKING:  # the server's imports load only when serving
    from .serve.app import ServerSettings

app = typer.Typer(
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="True batched inference for llama.cpp: many sequences, one llama_decode per step.",
)

_DEFAULT = SamplingParams()

ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Catalog name or path to a .gguf file.")]
CatalogOpt = Annotated[Optional[Path], typer.Option("--config", help="models.toml to use instead of the packaged one.")]
ParallelOpt = Annotated[
    Optional[str],
    typer.Option("--parallel", "-np", metavar="N|auto", help="Sequences decoded together (slots), or 'auto': as many as fit --memory, each with --ctx-per-seq cells."),
]
MemoryOpt = Annotated[Optional[str], typer.Option("--memory", help="With --parallel auto: the memory to plan for, e.g. 4GiB (default: what is free now).")]
CtxOpt = Annotated[Optional[int], typer.Option("--ctx", "-c", help="KV cache cells in all, shared by the slots.")]
CtxPerSeqOpt = Annotated[Optional[int], typer.Option("--ctx-per-seq", help="KV cells per sequence: the cache is this times --parallel.")]
BatchOpt = Annotated[Optional[int], typer.Option("--batch-size", "-b", help="Most tokens per llama_decode (n_batch).")]
UbatchOpt = Annotated[Optional[int], typer.Option("--ubatch-size", "-ub", help="Physical micro-batch (n_ubatch).")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", "-t", help="CPU threads (0 = all cores).")]
GpuLayersOpt = Annotated[Optional[int], typer.Option("--gpu-layers", "-ngl", help="Layers on the GPU, or with --rpc on the remotes (-1 = all).")]
RpcOpt = Annotated[Optional[str], typer.Option(
    "--rpc", metavar="HOST:PORT,...", help="rpc-servers whose devices hold the offloaded layers (llama.cpp's RPC backend).",
)]
RpcTimeoutOpt = Annotated[Optional[float], typer.Option(
    "--rpc-timeout", metavar="SECONDS", help="With --rpc: a decode unanswered this long means a remote is gone; the process exits (600).",
)]
TensorSplitOpt = Annotated[Optional[str], typer.Option(
    "--tensor-split", "-ts", metavar="N0,N1,...", help="Each device's share of the offloaded layers: the --rpc remotes in order, then local GPUs.",
)]
KvUnifiedOpt = Annotated[Optional[bool], typer.Option("--kv-unified/--no-kv-unified", help="One KV buffer shared by all sequences (default), or one each.")]
DeterministicOpt = Annotated[
    Optional[bool], typer.Option("--deterministic", help="Same output alone or in any batch (CPU; slower prefill, see README).")
]
SpeculativeOpt = Annotated[
    Optional[str], typer.Option("--speculative", help="'ngram': sequences draft tokens by prompt lookup, verified in the same decode; 'draft': a draft model drafts them; 'off'.")
]
DraftModelOpt = Annotated[
    Optional[str], typer.Option("--draft-model", metavar="NAME|PATH", help="A smaller model with the same vocabulary that drafts tokens (turns on --speculative draft).")
]
DraftMaxOpt = Annotated[Optional[int], typer.Option("--draft-max", help="Most draft tokens per sequence and step (15).")]
EmbedPackOpt = Annotated[Optional[int], typer.Option("--embed-pack", help="Tokens packed into one embedding decode (256; 2048 gives llama-embedding's own vectors).")]
ReplicasOpt = Annotated[Optional[str], typer.Option("--replicas", metavar="N|auto", help="Engines, on Ray: a number, or 'auto' (one per GPU, else one per node).")]
SharePrefixesOpt = Annotated[
    Optional[bool], typer.Option("--share-prefixes/--no-share-prefixes", help="Copy common prompt prefixes' KV instead of decoding them again.")
]
LoraOpt = Annotated[Optional[list[str]], typer.Option(
    "--lora", metavar="PATH[:SCALE]", help="A LoRA adapter applied to every sequence that asks for none (repeatable; a catalog adapter's NAME works too).",
)]
CacheTypeKOpt = Annotated[Optional[str], typer.Option("--cache-type-k", "-ctk", help="KV cache type of K: f16 (default), q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1, bf16, f32.")]
CacheTypeVOpt = Annotated[Optional[str], typer.Option("--cache-type-v", "-ctv", help="KV cache type of V (as --cache-type-k; a quantized V needs flash attention).")]
FlashAttnOpt = Annotated[Optional[str], typer.Option("--flash-attn", "-fa", metavar="auto|on|off", help="Flash attention (auto: where the backend has it).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Write JSON Lines to stdout.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's log.")]

# Sampling: `run` gives them SamplingParams' defaults, `batch` None (= not given: defaults apply).
MaxTokensOpt = Annotated[Optional[int], typer.Option("--max-tokens", help="Tokens to generate per prompt.")]
TemperatureOpt = Annotated[Optional[float], typer.Option("--temperature", "--temp", help="0 = greedy.")]
TopKOpt = Annotated[Optional[int], typer.Option("--top-k", help="0 = off.")]
TopPOpt = Annotated[Optional[float], typer.Option("--top-p", help="1 = off.")]
MinPOpt = Annotated[Optional[float], typer.Option("--min-p", help="0 = off.")]
RepeatPenaltyOpt = Annotated[Optional[float], typer.Option("--repeat-penalty", help="1 = off.")]
PresencePenaltyOpt = Annotated[Optional[float], typer.Option("--presence-penalty")]
FrequencyPenaltyOpt = Annotated[Optional[float], typer.Option("--frequency-penalty")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Same seed + same batch = same output.")]
StopOpt = Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable); not included in the text.")]
IgnoreEosOpt = Annotated[Optional[bool], typer.Option("--ignore-eos", help="Generate past end-of-generation tokens.")]
SamplesOpt = Annotated[Optional[int], typer.Option("-n", "--n", help="Samples per prompt; they share its KV (sample k: seed + k).")]
ChatOpt = Annotated[Optional[bool], typer.Option("--chat/--no-chat", help="Apply the model's chat template.")]
# Constrained output (at most one): every completion matches it.
JsonSchemaOpt = Annotated[Optional[Path], typer.Option("--json-schema", help="Constrain outputs to this JSON schema (a file).")]
GrammarOpt = Annotated[Optional[Path], typer.Option("--grammar", help="Constrain outputs to this GBNF grammar (a file).")]
RegexOpt = Annotated[Optional[str], typer.Option("--regex", help="Constrain outputs to this regular expression.")]
ChoiceOpt = Annotated[Optional[list[str]], typer.Option("--choice", help="Outputs are one of these strings (repeatable).")]


def command(fn):
    """Register a command whose LlamabatchErrors become one red line and exit code 1."""

    @functools.wraps(fn)
    def run_reporting_errors(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LlamabatchError as e:
            display.error_line(str(e))
            raise typer.Exit(1) from None

    return app.command()(run_reporting_errors)


@command
def run(
    context: typer.Context,
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="A prompt (repeatable).")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option(help="Prompts: one per line, or JSONL objects with 'prompt' and sampling fields.")] = None,
    model: ModelOpt = None,
    config: CatalogOpt = None,
    max_tokens: MaxTokensOpt = _DEFAULT.max_tokens,
    temperature: TemperatureOpt = _DEFAULT.temperature,
    top_k: TopKOpt = _DEFAULT.top_k,
    top_p: TopPOpt = _DEFAULT.top_p,
    min_p: MinPOpt = _DEFAULT.min_p,
    repeat_penalty: RepeatPenaltyOpt = _DEFAULT.repeat_penalty,
    presence_penalty: PresencePenaltyOpt = _DEFAULT.presence_penalty,
    frequency_penalty: FrequencyPenaltyOpt = _DEFAULT.frequency_penalty,
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
    batch_size: BatchOpt = None,
    ubatch_size: UbatchOpt = None,
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
    chat: ChatOpt = None,
    stream: Annotated[bool, typer.Option(help="Show each sequence's text live.")] = False,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Generate completions for many prompts, decoded together in one batch."""
    base = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        seed=seed, stop=tuple(stop or ()), ignore_eos=ignore_eos, n=n,
        **_constraint(json_schema, grammar, regex, choice),
    )
    prompts, params = gather_prompts(prompt or [], prompts_file, base)
    with BatchEngine(**EngineOptions.of(context.params).engine_kwargs(n_sequences=sum(p.n for p in params))) as engine:
        sequences = engine.submit(prompts, params)
        _drive(engine, sequences, live=stream and not json_out)
        results = [seq.result() for seq in sequences]
        stats = {"model": engine.model_name, "parallel": engine.config.n_parallel, **engine.stats.summary()}
    _report(results, stats, json_out=json_out, streamed=stream)
    if any(r.error for r in results):
        raise typer.Exit(1)


def _constraint(json_schema: Path | None, grammar: Path | None, regex: str | None, choice: list[str] | None) -> dict:
    """The SamplingParams fields for the constraint flags; files are read here."""
    fields: dict = {}
    if json_schema is not None:
        try:
            fields["json_schema"] = json.loads(_read(json_schema, "--json-schema"))
        except json.JSONDecodeError as e:
            raise LlamabatchError(f"--json-schema {json_schema}: not valid JSON ({e.msg})") from None
    if grammar is not None:
        fields["grammar"] = _read(grammar, "--grammar")
    if regex is not None:
        fields["regex"] = regex
    if choice:
        fields["choice"] = tuple(choice)
    return fields


def _read(path: Path, option: str) -> str:
    if not path.is_file():
        raise LlamabatchError(f"{option}: file not found: {path}")
    return path.read_text()


def _drive(engine: BatchEngine, sequences: list[Sequence], live: bool) -> None:
    """Step the engine to the end, showing live text or a progress bar on the way."""
    if live:
        with display.StreamView(sequences) as view:
            while engine.has_work:
                view.update(engine.step())
        return
    with display.progress(len(sequences)) as bar:
        task = bar.add_task("generate", total=len(sequences), completed=sum(s.finish_reason is not None for s in sequences))
        while engine.has_work:
            bar.advance(task, sum(e.finish_reason is not None for e in engine.step()))


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


@command
def batch(
    context: typer.Context,
    input: Annotated[str, typer.Argument(help="Requests: OpenAI batch lines, JSONL {\"prompt\", ...}, or one prompt a line; '-' = stdin; .gz read as is.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Results, one JSON line per request as it completes; resumed if it exists.")],
    errors: Annotated[Optional[Path], typer.Option("--errors", help="Failed requests (default: OUTPUT.errors.jsonl).")] = None,
    retry_errors: Annotated[bool, typer.Option("--retry-errors", help="Run the requests in the error file again.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start afresh instead of resuming.")] = False,
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
    batch_size: BatchOpt = None,
    ubatch_size: UbatchOpt = None,
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
    chat: ChatOpt = None,
    ray: Annotated[Optional[str], typer.Option(
        "--ray", metavar="ADDRESS", help="Run on a Ray cluster: 'local' (a Ray instance on this machine), 'auto' (the running cluster) or ray://host:port.",
    )] = None,
    replicas: ReplicasOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the final summary as one JSON object.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Run a job file of any size: results stream to OUTPUT as they finish; a rerun resumes."""
    from .jobs.batch_job import BatchJob, stop_on_signals

    given = dict(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        seed=seed, stop=stop and tuple(stop), ignore_eos=ignore_eos, n=n, **_constraint(json_schema, grammar, regex, choice),
    )
    given = {k: v for k, v in given.items() if v is not None}
    base = SamplingParams(**given) if given else None
    if replicas is not None and ray is None:
        raise LlamabatchError("--replicas runs engines on Ray: add --ray local|auto|ADDRESS, or drop --replicas")
    if ray is not None and parallel == AUTO:
        raise LlamabatchError("--parallel auto plans for this machine's memory, not the Ray actors': give --parallel N")
    engine_options = EngineOptions.of(context.params).engine_kwargs()
    if ray is not None:
        summary, job = _batch_on_ray(ray, _replicas(replicas), engine_options, input, output, errors, base, retry_errors,
                                     overwrite, incomplete_errors)
        described = {"model": job.settings["model"], "replicas": replicas or "1", "ray": ray, **summary.to_dict()}
    else:
        with BatchEngine(**engine_options) as engine:
            job = BatchJob(engine, input, output, errors=errors, base=base, retry_errors=retry_errors, overwrite=overwrite,
                           incomplete_errors=incomplete_errors)
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
            f"(and retry the failed requests) with: {_command_line(context, drop={'overwrite', 'retry_errors'})} --retry-errors"
        )
        raise typer.Exit(1)
    if not summary.complete:
        display.error_line(
            f"stopped by {summary.stopped_by}: {summary.done} requests done in this run; "
            f"resume with: {_command_line(context, drop={'overwrite'})}"
        )
        raise typer.Exit(130 if summary.stopped_by == "SIGINT" else 143)
    if summary.failed:
        display.error_line(f"{summary.failed} requests failed: see {job.errors}")
        raise typer.Exit(1)


@command
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
    from .embeddings_format import EmbedSettings
    from .jobs.batch_job import BatchJob, stop_on_signals

    settings = EmbedSettings(_pooling(pooling, per_token=True), normalize, dimensions, truncate)
    # The generation context is not used: one small slot.
    engine_options = {**EngineOptions.of(context.params).engine_kwargs(), "n_parallel": 1, "n_ctx": 256}
    with BatchEngine(**engine_options) as engine:
        job = BatchJob(engine, input, output, errors=errors, retry_errors=retry_errors, overwrite=overwrite, embed=settings)
        with stop_on_signals(job), display.BatchProgress(job.summary, tokens="embedded") as progress:
            job.on_progress = progress.update
            summary = job.run()
        described = {"model": engine.model_name, "pooling": engine.embedder(settings.pooling).pooling.value, **summary.embed_dict()}
    _report_job(context, job, summary, described, json_out, display.embed_summary)


def _pooling(text: str | None, per_token: bool = False):
    """--pooling: mean, cls or last, and where a line may hold a vector per token (`embed`) none;
    None leaves the GGUF's choice (a reranker's rank is only its GGUF's)."""
    from .engine.embedding import Pooling

    allowed = ("mean", "cls", "last", "none") if per_token else ("mean", "cls", "last")
    if text is not None and text not in allowed:
        hint = "" if per_token or text != "none" else "; per-token vectors: llamabatch embed --pooling none"
        raise LlamabatchError(f"--pooling must be {', '.join(allowed)}, got {text!r} (rerankers score pairs: serve /v1/rerank){hint}")
    return Pooling(text) if text else None


def _replicas(text: str | None) -> int | str:
    """--replicas N (at least 1) or 'auto' (decided once Ray shows the cluster)."""
    if text is None:
        return 1
    if text == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise LlamabatchError(f"--replicas must be a number >= 1 or 'auto', got {text!r}")
    return value


def _batch_on_ray(
    address: str, replicas: int | str, engine_options: dict, input: str, output: Path, errors: Path | None,
    base: SamplingParams | None, retry_errors: bool, overwrite: bool, incomplete_errors: bool,
):
    try:
        from .jobs import ray_stage
    except ImportError as e:
        raise LlamabatchError(f"--ray needs Ray: pip install 'llamabatch[ray]' ({e})") from None
    from .jobs.batch_job import stop_on_signals

    threads = engine_options.pop("n_threads")
    job = ray_stage.RayBatchJob(engine_options, input, output, address=address, replicas=replicas, threads=threads, errors=errors,
                                base=base, retry_errors=retry_errors, overwrite=overwrite, incomplete_errors=incomplete_errors)
    with stop_on_signals(job), display.BatchProgress(job.summary) as progress:
        job.on_progress = progress.update
        return job.run(), job


def _command_line(context: typer.Context, drop: set[str]) -> str:
    """The command being run, as typed (the options given on the command line), without `drop`."""
    words = ["llamabatch", context.info_name]
    for param in context.command.params:
        if param.name in drop or context.get_parameter_source(param.name).name != "COMMANDLINE":
            continue
        value = context.params[param.name]
        if param.param_type_name == "argument":
            words.append(str(value))
        elif param.is_flag:
            words.append(param.opts[0] if value else param.secondary_opts[0])
        else:
            for v in value if param.multiple else [value]:
                words += [param.opts[0], str(v)]
    return shlex.join(words)


@command
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
    batch_size: BatchOpt = None,
    ubatch_size: UbatchOpt = None,
    threads: ThreadsOpt = None,
    gpu_layers: GpuLayersOpt = None,
    rpc: RpcOpt = None,
    tensor_split: TensorSplitOpt = None,
    rpc_timeout: RpcTimeoutOpt = None,
    lora: LoraOpt = None,
    cache_type_k: CacheTypeKOpt = None,
    cache_type_v: CacheTypeVOpt = None,
    flash_attn: FlashAttnOpt = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Log-likelihoods and perplexity: each continuation given its context, or whole texts."""
    from .jobs.prompts import read_score_items

    if (items is None) == (text is None):
        raise LlamabatchError("give ITEMS (a JSON Lines file) or --text FILE, not both")
    if text is not None and not text.is_file():
        raise LlamabatchError(f"text file not found: {text}")
    if chunk is not None and chunk < 4:
        raise LlamabatchError(f"--chunk must be at least 4 tokens, got {chunk}")
    scored = [text.read_text(errors="replace")] if text is not None else read_score_items(items)
    with BatchEngine(**EngineOptions.of(context.params).engine_kwargs(n_sequences=len(scored))) as engine:
        started = time.perf_counter()
        scores = engine.score(scored, bos=bos, chunk=chunk)
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
        for s in scores:
            if s.error:
                display.error_line(f"item {s.index}: {s.error}")
        display.summary(summary)
    if any(s.error for s in scores):
        raise typer.Exit(1)


@command
def models(config: CatalogOpt = None, json_out: JsonOpt = False, verbose: VerboseOpt = False) -> None:
    """List the catalog's models, with GGUF metadata for those available here."""
    catalog = Catalog.load(config)
    init_backend(verbose)
    rows = [_model_row(spec) for spec in catalog.models.values()]
    if json_out:
        for row in rows:
            display.json_line(row)
    else:
        display.models_table(rows)


@command
def plan(
    model: ModelOpt = None,
    config: CatalogOpt = None,
    ctx_per_seq: Annotated[Optional[int], typer.Option("--ctx-per-seq", help="KV cells per sequence (default: the catalog's).")] = None,
    memory: Annotated[Optional[str], typer.Option("--memory", help="The memory to plan for, e.g. 4GiB (default: what is free now).")] = None,
    kv_unified: Annotated[bool, typer.Option("--kv-unified/--no-kv-unified", help="Plan one KV buffer shared by all sequences.")] = EngineConfig.kv_unified,
    ubatch_size: UbatchOpt = None,
    cache_type_k: CacheTypeKOpt = None,
    cache_type_v: CacheTypeVOpt = None,
    check: Annotated[bool, typer.Option(help="Create the planned context and compare with the KV buffer llama.cpp allocates.")] = False,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """How much KV cache each token costs, and the largest --parallel that fits the memory budget."""
    planned, shape = plan_for(
        model, catalog=config, ctx_per_seq=ctx_per_seq, memory=memory_budget(memory), kv_unified=kv_unified,
        n_ubatch=ubatch_size, cache_type_k=cache_type_k, cache_type_v=cache_type_v, verbose=verbose,
    )
    row = {**asdict(planned), "n_ctx": planned.n_ctx, "total_bytes": planned.total_bytes, **asdict(shape),
           "kv_bytes_per_token": shape.bytes_per_token, "cache_type_k": cache_type_k or "f16", "cache_type_v": cache_type_v or "f16"}
    if check:
        planned_options = EngineOptions(model=model, config=config, parallel=planned.n_parallel, ctx=planned.n_ctx,
                                        ubatch_size=ubatch_size, kv_unified=kv_unified, cache_type_k=cache_type_k,
                                        cache_type_v=cache_type_v, verbose=verbose)
        with BatchEngine(**planned_options.engine_kwargs()) as engine:
            row["allocated_kv_bytes"] = engine.ctx.kv_bytes
    if json_out:
        display.json_line(row)
    else:
        display.plan_table(row)


@command
def sweep(
    context: typer.Context,
    model: ModelOpt = None,
    config: CatalogOpt = None,
    batch_sizes: Annotated[str, typer.Option(help="Batch sizes B to measure, comma-separated.")] = "1,2,4,8,16,32",
    prompt_tokens: Annotated[int, typer.Option(help="Prompt tokens per sequence (PP).")] = 32,
    gen_tokens: Annotated[int, typer.Option(help="Generated tokens per sequence (TG).")] = 64,
    shared_prompt: Annotated[bool, typer.Option(help="One prompt for all B sequences, decoded once (llama-batched-bench -pps).")] = False,
    repeat: Annotated[int, typer.Option(help="Runs per batch size; the median is reported.")] = 1,
    baseline: Annotated[Optional[list[str]], typer.Option(help="Also measure 'sequential' (llama-cpp-python's Llama, one prompt at a time) and/or 'native' (llama-batched-bench).")] = None,
    ctx: Annotated[Optional[int], typer.Option("--ctx", "-c", help="KV cache cells in all (default: room for the largest B).")] = None,
    batch_size: BatchOpt = None,
    ubatch_size: UbatchOpt = None,
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
    deterministic: DeterministicOpt = None,
    speculative: SpeculativeOpt = None,
    draft_model: DraftModelOpt = None,
    json_out: JsonOpt = False,
    csv: Annotated[Optional[Path], typer.Option("--csv", help="Also write the table to this CSV file.")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Also draw throughput and latency against B into this PNG.")] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Throughput and latency against batch size, as llama-batched-bench measures them."""
    baselines = set(baseline or ())
    if baselines - {"sequential", "native"}:
        raise LlamabatchError(f"unknown baseline {sorted(baselines - {'sequential', 'native'})}: use sequential or native")
    settings = sweep_bench.SweepSettings(
        batch_sizes=_int_list(batch_sizes, "--batch-sizes"), prompt_tokens=prompt_tokens, gen_tokens=gen_tokens,
        shared_prompt=shared_prompt, repeat=repeat, n_ctx=ctx,
    )
    # The engine as any command builds it, sized for the largest batch; the baselines take its settings.
    options = replace(EngineOptions.of(context.params), parallel=max(settings.batch_sizes), ctx=settings.context,
                      share_prefixes=shared_prompt and not deterministic)
    if "native" in baselines:
        sweep_bench.native_tool()  # fail now, not after minutes of measuring
    if plot is not None:
        from .measure import plot as plotting  # matplotlib is an extra: say so before measuring
    points, title = _sweep(options, settings, baselines, json_out=json_out)
    if csv is not None:
        display.write_csv(csv, [p.to_dict() for p in points])
    if plot is not None:
        plotting.sweep_plot(points, plot, title=title)


def _sweep(
    options: EngineOptions, settings: sweep_bench.SweepSettings, baselines: set[str], *, json_out: bool
) -> tuple[list[sweep_bench.SweepPoint], str]:
    """Measure every batch size, then the baselines, showing the table as it fills. Returns the
    points and a title for the plot."""
    sizes = settings.batch_sizes
    n_steps = len(sizes) * (2 if "sequential" in baselines else 1)
    with BatchEngine(**options.engine_kwargs()) as engine, \
            display.SweepView(engine.model_name, settings, engine.config, n_steps, live=not json_out) as view:
        if baselines and engine.config.rpc:
            raise LlamabatchError(
                "--baseline with --rpc: an rpc-server serves one client at a time, so a baseline cannot run beside "
                "this engine (scripts/bench_rpc.py alternates whole processes instead)"
            )
        points = []
        for point in sweep_bench.sweep(engine, settings, native="native" in baselines):
            points.append(point)
            view.show(points, f"B={point.batch_size}")
        if "sequential" in baselines:
            for point in points:
                point.add_sequential(*sweep_bench.sequential_baseline(engine, settings, point.batch_size))
                view.show(points, f"sequential B={point.batch_size}")
        view.show(points, "all", done=True)
        title = f"{engine.model_name}: PP {settings.prompt_tokens}, TG {settings.gen_tokens}, {sweep_bench.describe(settings, engine.config)}"
    if json_out:
        for point in points:
            display.json_line(point.to_dict())
    return points, title


@command
def serve(
    context: typer.Context,
    model: ModelOpt = None,
    config: CatalogOpt = None,
    parallel: ParallelOpt = None,
    ctx: CtxOpt = None,
    ctx_per_seq: CtxPerSeqOpt = None,
    memory: MemoryOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(help="Require 'Authorization: Bearer KEY' on /v1 routes.")] = None,
    max_queue: Annotated[int, typer.Option(help="Sequences (and embedding requests) that may wait; beyond, requests get 429.")] = 256,
    request_timeout: Annotated[float, typer.Option(help="Seconds before a request is cancelled (504).")] = 600.0,
    pooling: Annotated[Optional[str], typer.Option(help="/v1/embeddings: mean, cls or last (default: the GGUF's, else mean).")] = None,
    embed_pack: EmbedPackOpt = None,
    data_dir: Annotated[Optional[Path], typer.Option(help="Files and batches of the Batch API (/v1/files, /v1/batches), kept across restarts (default: ~/.local/share/llamabatch).")] = None,
    max_upload_mb: Annotated[int, typer.Option(help="Largest file upload, in MiB (413 beyond).")] = 200,
    scheduling_policy: Annotated[Optional[str], typer.Option(help="'priority' (default: by the requests' priority, batches below interactive requests, preempting) or 'fcfs'.")] = None,
    batch_size: BatchOpt = None,
    ubatch_size: UbatchOpt = None,
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
    replicas: ReplicasOpt = None,
    ray: Annotated[Optional[str], typer.Option("--ray", metavar="ADDRESS", help="With --replicas: 'local' (default), 'auto' (the running cluster) or ray://host:port.")] = None,
    verbose: VerboseOpt = False,
) -> None:
    """An OpenAI-compatible server: concurrent requests share the running batch."""
    import uvicorn

    from .serve.app import ServerSettings, create_app
    from .serve.store import default_data_dir

    if ray is not None and replicas is None:
        raise LlamabatchError("--ray says where --replicas run: add --replicas N|auto, or drop --ray")
    if replicas is not None and parallel == AUTO:
        raise LlamabatchError("--parallel auto plans for this machine's memory, not each replica's: give --parallel N")
    for name in (model, draft_model) if draft_model else (model,):  # an unknown model or a missing file fails here, not in a thread
        Catalog.load(config).resolve(name).gguf_path()
    engine = EngineOptions.of(context.params).engine_kwargs()
    if max_upload_mb < 1:
        raise LlamabatchError(f"--max-upload-mb must be >= 1, got {max_upload_mb}")
    if replicas is not None and data_dir is not None:
        raise LlamabatchError("--data-dir is for the Batch API of one server; replicas (--replicas) serve no batches")
    settings = ServerSettings(engine=engine, api_key=api_key, max_queue=max_queue, request_timeout=request_timeout,
                              pooling=_pooling(pooling), max_upload=max_upload_mb << 20,
                              data_dir=None if replicas is not None else data_dir or default_data_dir())
    if replicas is not None:
        _serve_replicas(settings, _replicas(replicas), ray or "local", host, port)
        return
    app = create_app(settings)
    display.err.print(f"llamabatch serving on http://{host}:{port}/v1 (Ctrl-C stops)")
    uvicorn.run(app, host=host, port=port, log_level="info" if verbose else "warning")


def _serve_replicas(settings: ServerSettings, replicas: int | str, address: str, host: str, port: int) -> None:
    try:
        from .jobs.ray_stage import actor_shape, connect
        from .serve.replicas import deploy
    except ImportError as e:
        raise LlamabatchError(f"--replicas needs Ray: pip install 'llamabatch[ray]' ({e})") from None
    import ray
    from ray import serve

    connect(address)
    engine = settings.engine
    replicas, threads, gpus = actor_shape(replicas, engine["n_threads"])
    slots = engine["n_parallel"] or Catalog.load(engine["catalog"]).resolve(engine["model"]).parallel
    deploy(settings, replicas, threads, gpus, host, port, slots)
    display.err.print(f"llamabatch serving {replicas} replicas on http://{host}:{port}/v1 (Ctrl-C stops)")
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    serve.shutdown()
    ray.shutdown()


@command
def rpc_server(
    host: Annotated[str, typer.Option("--host", "-H", help="Address to listen on. The protocol has no authentication: keep it on a trusted network.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", help="Port to listen on.")] = DEFAULT_RPC_PORT,
    threads: ThreadsOpt = None,
) -> None:
    """Lend this host's GPUs (else its CPU) to engines on other hosts: llama.cpp's rpc-server,
    from llama-cpp-python's own libraries (built with -DGGML_RPC=on)."""
    from .engine import rpc

    rpc.require_rpc()
    init_backend(False)
    # ggml's server loop returns only when it cannot listen: run it on a thread, so that Ctrl-C
    # still ends the process.
    server = threading.Thread(target=rpc.serve, args=(host, port, threads or max(1, (os.cpu_count() or 2) // 2)), daemon=True)
    server.start()
    try:
        while server.is_alive():
            server.join(0.5)
    except KeyboardInterrupt:
        return
    raise LlamabatchError(f"rpc-server could not listen on {host}:{port} (is the port taken?)")


@command
def verify_determinism(
    model: ModelOpt = None,
    config: CatalogOpt = None,
    prompts: Annotated[Optional[Path], typer.Option(help="Prompts, one per line (default: 16 built-in, about 10 to 400 tokens).")] = None,
    batch_sizes: Annotated[str, typer.Option(help="Batch sizes to compare with the solo runs, comma-separated (as sweep's).")] = "8,16",
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy; above, seeded sampling.")] = 0.0,
    seed: int = 1,
    deterministic: Annotated[bool, typer.Option("--deterministic/--no-deterministic", help="Check the deterministic mode, or llama.cpp's defaults.")] = True,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Run each prompt alone and in batches; print the share whose tokens are identical."""
    from .measure.determinism import read_prompts, verify

    if prompts is not None and not prompts.is_file():
        raise LlamabatchError(f"prompts file not found: {prompts}")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True)
    checks = verify(
        read_prompts(prompts), list(_int_list(batch_sizes, "--batch-sizes")), params, deterministic=deterministic,
        model=model, catalog=config, n_threads=threads, verbose=verbose,
    )
    if json_out:
        for check in checks:
            display.json_line(asdict(check))
    else:
        display.determinism_table(checks, deterministic)
    if not all(c.identical for c in checks):
        raise typer.Exit(1)


def _int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise LlamabatchError(f"{option} must be comma-separated integers, got {text!r}") from None


def _model_row(spec: ModelSpec) -> dict:
    row = {"name": spec.name, "source": spec.source, "available": spec.is_available(), "description": spec.description}
    if not row["available"]:
        return row
    path = spec.gguf_path()
    with Model(path, gpu_layers=0) as model:
        arch, _size_label, quant = model.description.split(" ", 2)
        row.update(
            architecture=arch, parameters=model.n_params, quantization=quant,
            trained_ctx=model.n_ctx_train, file_bytes=path.stat().st_size, path=str(path),
        )
    return row


def _result_json(result: Result) -> dict:
    data = result.to_dict()
    data.pop("token_ids")
    data.pop("n_samples")
    if data["error"] is None:
        data.pop("error")
    return data


def main() -> None:
    app()


if __name__ == "__main__":
    main()
