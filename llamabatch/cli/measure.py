"""`models`, `plan`, `sweep` and `verify-determinism`: what a model is, fits and does."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import display
from ..catalog import Catalog, ModelSpec
from ..engine import BatchEngine, EngineConfig, SamplingParams
from ..engine.sizing.planning import plan_for
from ..engine.native.handles import Model
from ..engine.native.backend import init_backend
from ..engine.sizing import tuning
from ..engine.config import size_option
from ..engine.sizing.options import EngineOptions, memory_budget
from ..errors import LlamabatchError
from ..measure import sweep as sweep_bench
from .options import CacheRamOpt, BatchOpt, CacheTypeKOpt, CacheTypeVOpt, CatalogOpt, DeterministicOpt, OverlapOpt, DraftModelOpt, FlashAttnOpt, GpuLayersOpt, JsonOpt, KvUnifiedOpt, LoraOpt, MemoryOpt, ModelOpt, RpcOpt, RpcTimeoutOpt, SpeculativeOpt, TensorSplitOpt, ThreadsOpt, UbatchOpt, VerboseOpt, int_list, reports_errors


@reports_errors
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


@reports_errors
def plan(
    model: ModelOpt = None,
    config: CatalogOpt = None,
    ctx_per_seq: Annotated[Optional[int], typer.Option("--ctx-per-seq", help="KV cells per sequence (default: the catalog's).")] = None,
    memory: Annotated[Optional[str], typer.Option("--memory", help="The memory to plan for, e.g. 4GiB (default: what is free now).")] = None,
    kv_unified: Annotated[bool, typer.Option("--kv-unified/--no-kv-unified", help="Plan one KV buffer shared by all sequences.")] = EngineConfig.kv_unified,
    n_ubatch: UbatchOpt = None,
    cache_type_k: CacheTypeKOpt = None,
    cache_type_v: CacheTypeVOpt = None,
    cache_ram: CacheRamOpt = None,
    check: Annotated[bool, typer.Option(help="Create the planned context and compare with the KV buffer llama.cpp allocates.")] = False,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """How much KV cache each token costs, and the largest --parallel that fits the memory budget."""
    planned, shape = plan_for(
        model, catalog=config, ctx_per_seq=ctx_per_seq, memory=memory_budget(memory), kv_unified=kv_unified,
        n_ubatch=n_ubatch, cache_type_k=cache_type_k, cache_type_v=cache_type_v, verbose=verbose,
        cache_ram=0 if cache_ram is None else size_option(cache_ram, "--cache-ram"),
    )
    row = {**asdict(planned), "n_ctx": planned.n_ctx, "total_bytes": planned.total_bytes, **asdict(shape),
           "kv_bytes_per_token": shape.bytes_per_token, "cache_type_k": cache_type_k or "f16", "cache_type_v": cache_type_v or "f16"}
    if check:
        planned_options = EngineOptions(model=model, config=config, parallel=planned.n_parallel, ctx=planned.n_ctx,
                                        n_ubatch=n_ubatch, kv_unified=kv_unified, cache_type_k=cache_type_k,
                                        cache_type_v=cache_type_v, verbose=verbose)
        with BatchEngine(**planned_options.engine_kwargs()) as engine:
            row["allocated_kv_bytes"] = engine.ctx.kv_bytes
    if json_out:
        display.json_line(row)
    else:
        display.plan_table(row)


@reports_errors
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
    deterministic: DeterministicOpt = None,
    overlap: OverlapOpt = None,
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
        batch_sizes=int_list(batch_sizes, "--batch-sizes"), prompt_tokens=prompt_tokens, gen_tokens=gen_tokens,
        shared_prompt=shared_prompt, repeat=repeat, n_ctx=ctx,
    )
    # The engine as any command builds it, sized for the largest batch; the baselines take its settings.
    options = replace(EngineOptions.of(context.params), parallel=max(settings.batch_sizes), ctx=settings.context,
                      share_prefixes=shared_prompt and not deterministic)
    if "native" in baselines:
        sweep_bench.native_tool()  # fail now, not after minutes of measuring
    if plot is not None:
        from ..measure import plot as plotting  # matplotlib is an extra: say so before measuring
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
                "this engine (`python -m benchmarks rpc` alternates whole processes instead)"
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


@reports_errors
def tune(
    context: typer.Context,
    model: ModelOpt = None,
    config: CatalogOpt = None,
    max_itl: Annotated[Optional[str], typer.Option("--max-itl", help="Choose the fastest batch size whose p95 time between a sequence's tokens stays within this, e.g. 150ms.")] = None,
    max_batch: Annotated[Optional[int], typer.Option("--max-batch", min=1, help="Largest batch size to try (default: what fits --memory, at most 256).")] = None,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", min=1, help="Prompt tokens per sequence: the prefill rate, and the context decode steps attend to.")] = 32,
    job: Annotated[Optional[Path], typer.Option("--job", help="A batch job file: measure with its mean prompt length, and choose the size that runs it soonest, prefill counted.")] = None,
    memory: MemoryOpt = None,
    again: Annotated[bool, typer.Option("--again", help="Measure even when a measurement is stored.")] = False,
    n_batch: BatchOpt = None,
    n_ubatch: UbatchOpt = None,
    threads: ThreadsOpt = None,
    gpu_layers: GpuLayersOpt = None,
    rpc: RpcOpt = None,
    tensor_split: TensorSplitOpt = None,
    lora: LoraOpt = None,
    cache_type_k: CacheTypeKOpt = None,
    cache_type_v: CacheTypeVOpt = None,
    flash_attn: FlashAttnOpt = None,
    kv_unified: KvUnifiedOpt = None,
    json_out: JsonOpt = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Also draw throughput and inter-token latency against B into this PNG.")] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Measure decode throughput and inter-token latency against batch size; choose and store the best."""
    if plot is not None:
        from ..measure import plot as plotting  # matplotlib is an extra: say so before measuring
    options = EngineOptions.of(context.params)
    shape = _job_shape(options, job) if job is not None else None
    if shape is not None:
        prompt_tokens = max(1, round(shape[0]))
    if max_batch is None:
        max_batch = options.memory_plan(ctx_per_seq=tuning.cells_per_sequence(prompt_tokens)).n_parallel
    with display.Steps("measuring batch sizes", every_s=0) as steps:
        found = options.tuning(max_batch, say=display.note, again=again, prompt_tokens=prompt_tokens, progress=steps.update)
    itl = options.max_itl_s
    chosen = found.choose(itl, job=shape)
    if json_out:
        display.json_line({**found.to_dict(), "chosen": chosen.batch_size, "max_itl_s": itl, "job": shape,
                           "within_max_itl": itl is None or chosen.itl_p95_s <= itl})
    else:
        display.tune_table(found, chosen, itl, shape)
    if plot is not None:
        plotting.tune_plot(found, chosen, plot)


def _job_shape(options: EngineOptions, job: Path) -> tuple[float, float]:
    """A job's mean prompt tokens and most new tokens per request, tokenized as the job would be."""
    from ..jobs.estimate import estimate

    with BatchEngine(**options.engine_kwargs_for(1)) as engine:
        counted = estimate(engine, job, None, None)
    if not counted.requests:
        raise LlamabatchError(f"--job {job}: no request in it to measure with")
    return counted.prompt_tokens / counted.requests, counted.max_new_tokens / counted.requests


@reports_errors
def verify_determinism(
    model: ModelOpt = None,
    config: CatalogOpt = None,
    prompts: Annotated[Optional[Path], typer.Option(help="Prompts, one per line (default: 16 built-in, about 10 to 400 tokens).")] = None,
    batch_sizes: Annotated[str, typer.Option(help="Batch sizes to compare with the solo runs, comma-separated (as sweep's).")] = "8,16",
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy; above, seeded sampling.")] = 0.0,
    seed: int = 1,
    ctx_per_seq: Annotated[int, typer.Option("--ctx-per-seq", min=1, help="KV cells of each sequence, alone and in every batch: a prompt and its --max-tokens must fit.")] = 1024,
    deterministic: Annotated[bool, typer.Option("--deterministic/--no-deterministic", help="Check the deterministic mode, or llama.cpp's defaults.")] = True,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Run each prompt alone and in batches; print the share whose tokens are identical."""
    from ..measure.determinism import read_prompts, verify

    if prompts is not None and not prompts.is_file():
        raise LlamabatchError(f"prompts file not found: {prompts}")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True)
    with display.Steps("verifying", every_s=0) as steps:
        checks = verify(
            read_prompts(prompts), list(int_list(batch_sizes, "--batch-sizes")), params, deterministic=deterministic,
            ctx_per_seq=ctx_per_seq, progress=steps.update, model=model, catalog=config, n_threads=threads, verbose=verbose,
        )
    if json_out:
        for check in checks:
            display.json_line(asdict(check))
    else:
        display.determinism_table(checks, deterministic)
    if not all(c.identical for c in checks):
        raise typer.Exit(1)
