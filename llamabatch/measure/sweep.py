"""`llamabatch sweep`: throughput and latency against batch size, with llama-batched-bench's definitions.

For B sequences of PP prompt tokens generating TG tokens each (as llama-batched-bench):
  T_PP  prefill: until every sequence has sampled its first token
  T_TG  the TG decode steps after it, each advancing all B sequences by one token
  S_PP = B*PP / T_PP (PP / T_PP with a shared prompt), S_TG = B*TG / T_TG, S = N_KV / (T_PP + T_TG)
Prompts are random token ids and generation ignores end-of-sequence, so every B does the same work.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import llama_cpp
import numpy as np

from ..engine import BatchEngine, EngineConfig, SamplingParams, Sequence
from ..errors import LlamabatchError
from ..engine.sizing.planning import KvShape, pad


@dataclass(frozen=True)
class SweepSettings:
    """The workload. Everything else (KV layout, batch sizes, threads, GPU layers) is the engine's
    own resolved config, which the baselines read too: both sides always run alike."""

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    prompt_tokens: int = 32
    gen_tokens: int = 64
    shared_prompt: bool = False
    repeat: int = 1
    n_ctx: int | None = None  # default: room for the largest batch

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise LlamabatchError(f"batch sizes must be >= 1, got {list(self.batch_sizes)}")
        for name in ("prompt_tokens", "gen_tokens", "repeat"):
            if getattr(self, name) < 1:
                raise LlamabatchError(f"--{name.replace('_', '-')} must be >= 1")

    @property
    def context(self) -> int:
        """Total KV cells: each of max(B) sequences holds PP + TG + 1 tokens, rounded to llama.cpp's 256."""
        per_seq = pad(self.prompt_tokens + self.gen_tokens + 1)
        return self.n_ctx or max(self.batch_sizes) * per_seq

    def n_kv(self, b: int, kv_unified: bool) -> int:
        """llama-batched-bench's N_KV: the tokens the batch puts in the KV cache."""
        prompt = self.prompt_tokens * (1 if self.shared_prompt and kv_unified else b)
        return prompt + b * self.gen_tokens


def describe(settings: SweepSettings, config: EngineConfig) -> str:
    """The KV layout and modes a sweep ran with, for captions."""
    return (("unified" if config.kv_unified else "per-sequence") + f" KV {config.cache_type_k}/{config.cache_type_v}"
            + f", flash attention {config.flash_attn}"
            + (", shared prompt" if settings.shared_prompt else "")
            + (", deterministic" if config.deterministic else "")
            + (f", speculative {config.speculative}" if config.speculative != "off" else "")
            + (f", LoRA {', '.join(config.lora)}" if config.lora else "")
            + (f", RPC {','.join(config.rpc)}" if config.rpc else "")
            + (f", tensor split {','.join(f'{x:g}' for x in config.tensor_split)}" if config.tensor_split else ""))


@dataclass
class SweepPoint:
    batch_size: int
    prompt_tokens: int
    gen_tokens: int
    n_kv: int
    t_pp: float
    s_pp: float
    t_tg: float
    s_tg: float
    t: float
    s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    kv_bytes: int  # the KV cache a context sized for this batch allocates
    peak_rss_bytes: int
    draft_acceptance: float = 0.0  # speculative tokens the model agreed with / those verified
    tokens_per_decode: float = 1.0  # tokens sampled per llama_decode, prefill steps included
    speedup: float = 1.0  # S_TG / S_TG at the smallest batch size
    efficiency: float = 1.0  # speedup / (B / smallest B)
    sequential_s_tg: float | None = None
    sequential_s: float | None = None
    speedup_vs_sequential: float | None = None  # S / sequential S
    native_s_pp: float | None = None
    native_s_tg: float | None = None
    native_s: float | None = None
    s_tg_ratio: float | None = None  # S_TG / native S_TG

    def add_sequential(self, s_tg: float, s: float) -> None:
        self.sequential_s_tg, self.sequential_s = s_tg, s
        self.speedup_vs_sequential = self.s / s

    def to_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


# -- llamabatch ----------------------------------------------------------------------


def random_prompts(n: int, length: int, n_vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, n_vocab, size=(n, length)).tolist()


def measure(engine: BatchEngine, settings: SweepSettings, b: int, seed: int = 0) -> SweepPoint:
    """One batch of b sequences through the engine, timed step by step."""
    pp, tg = settings.prompt_tokens, settings.gen_tokens
    # TG + 1 tokens: the first is sampled by the prefill, then TG steps decode B tokens each.
    params = SamplingParams(temperature=0, max_tokens=tg + 1, ignore_eos=True)
    engine.drop_cached_prefixes()  # as llama-batched-bench clears its cache before each batch
    engine.reset_stats()
    reset_peak_rss()
    # No one reads the tokens as they come (as llama-batched-bench reads none): no event a token.
    if settings.shared_prompt:
        sequences = engine.submit(random_prompts(1, pp, engine.vocab.n_vocab, seed), replace(params, n=b), streamed=False)
    else:
        sequences = engine.submit(random_prompts(b, pp, engine.vocab.n_vocab, seed), params, streamed=False)
    started = time.perf_counter()
    while any(seq.t_first_token is None for seq in sequences):
        engine.step()
    prefilled = time.perf_counter()
    # With B*PP > n_batch the first prompts start generating while later ones prefill
    # (decode-first scheduling): S_TG counts only the tokens generated after the prefill.
    n_generated = b * (tg + 1) - sum(len(seq.tokens) - seq.n_prompt for seq in sequences)
    while engine.has_work:
        engine.step()
    finished = time.perf_counter()
    t_pp, t_tg = prefilled - started, finished - prefilled
    n_prompt = pp if settings.shared_prompt else b * pp
    return SweepPoint(
        batch_size=b, prompt_tokens=pp, gen_tokens=tg, n_kv=settings.n_kv(b, engine.config.kv_unified),
        t_pp=t_pp, s_pp=n_prompt / t_pp, t_tg=t_tg, s_tg=n_generated / t_tg, t=t_pp + t_tg,
        s=(n_prompt + b * tg) / (t_pp + t_tg),
        **latency_percentiles(sequences),
        kv_bytes=KvShape.of(engine.model, *engine.ctx.cache_types).kv_bytes(b * (pp + tg + 1), b, engine.config.kv_unified, engine.config.n_ubatch),
        peak_rss_bytes=peak_rss(),
        draft_acceptance=engine.stats.acceptance_rate,
        tokens_per_decode=engine.stats.completion_tokens / engine.stats.decode_calls,
    )


def latency_percentiles(sequences: list[Sequence]) -> dict[str, float]:
    ttft = [s.t_first_token - s.t_submitted for s in sequences]
    tpot = [(s.t_finished - s.t_first_token) / max(1, s.n_generated - 1) for s in sequences]
    return {
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
        "tpot_p50_s": float(np.percentile(tpot, 50)), "tpot_p99_s": float(np.percentile(tpot, 99)),
    }


def median_point(points: list[SweepPoint]) -> SweepPoint:
    """Each field's median over repeated runs."""
    values = {f.name: [getattr(p, f.name) for p in points] for f in fields(SweepPoint)}
    return SweepPoint(**{
        name: (type(vs[0])(np.median(vs)) if vs[0] is not None else None) for name, vs in values.items()
    })


def sweep(engine: BatchEngine, settings: SweepSettings, native: bool = False) -> Iterator[SweepPoint]:
    """Measure each batch size (median of settings.repeat runs) after one warm-up batch. With
    native, llama-batched-bench runs beside each of ours, so drift hits both alike."""
    measure(engine, replace(settings, gen_tokens=8), max(settings.batch_sizes), seed=99)
    first = None
    for b in settings.batch_sizes:
        ours, theirs = [], []
        for r in range(settings.repeat):
            if native and r % 2:  # alternate who goes first, so slow drift favours neither
                theirs.append(native_run(engine, settings, b))
            ours.append(measure(engine, settings, b, seed=r))
            if native and not r % 2:
                theirs.append(native_run(engine, settings, b))
        point = median_point(ours)
        first = first or point
        point.speedup = point.s_tg / first.s_tg
        point.efficiency = point.speedup / (b / first.batch_size)
        if native:
            point.native_s_pp, point.native_s_tg, point.native_s = (
                float(np.median([row[k] for row in theirs])) for k in ("speed_pp", "speed_tg", "speed")
            )
            point.s_tg_ratio = point.s_tg / point.native_s_tg
        yield point


# -- memory ----------------------------------------------------------------------------


def reset_peak_rss() -> None:
    """Start a new peak: Linux resets VmHWM when 5 is written to clear_refs."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # not on Windows; ru_maxrss is KiB on Linux, bytes on macOS

    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return usage if os.uname().sysname == "Darwin" else usage * 1024


# -- baselines -----------------------------------------------------------------------


def sequential_baseline(engine: BatchEngine, settings: SweepSettings, b: int) -> tuple[float, float]:
    """The same b prompts one after another through llama-cpp-python's high-level Llama
    (greedy, EOS ignored), on the engine's device and threads; returns (S_TG, S) by the same
    definitions."""
    from llama_cpp import Llama

    pp, tg = settings.prompt_tokens, settings.gen_tokens
    llm = Llama(str(engine.model.path), **sequential_settings(engine.config, settings), verbose=False)
    try:
        t_tg = t_all = 0.0
        for prompt in random_prompts(b, pp, llm.n_vocab(), seed=0):
            started = time.perf_counter()
            tokens = llm.generate(prompt, top_k=1, temp=0, reset=True)
            next(tokens)  # the prompt is evaluated and the first token sampled
            first = time.perf_counter()
            for _ in range(tg):
                next(tokens)
            done = time.perf_counter()
            tokens.close()
            t_tg += done - first
            t_all += done - started
    finally:
        llm.close()
    return b * tg / t_tg, b * (pp + tg) / t_all


def sequential_settings(config: EngineConfig, settings: SweepSettings) -> dict:
    """Llama's keyword arguments: one sequence's context, the engine's batch sizes, threads and GPU layers."""
    return dict(
        n_ctx=pad(settings.prompt_tokens + settings.gen_tokens + 1), n_batch=config.n_batch,
        n_ubatch=config.n_ubatch, n_threads=config.n_threads, n_threads_batch=config.n_threads, n_gpu_layers=config.gpu_layers,
    )


def native_tool(name: str = "llama-batched-bench") -> Path:
    """A tool built by scripts/build_native.sh for the installed llama-cpp-python version."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    folder = Path(os.environ.get("LLAMABATCH_NATIVE_DIR") or cache / "llamabatch" / "native" / llama_cpp.__version__)
    tool = folder / "bin" / name
    if not tool.is_file():
        raise LlamabatchError(
            f"{name} not found in {tool.parent}: build it with scripts/build_native.sh "
            "(about 12 minutes; same llama.cpp sources as the installed llama-cpp-python)"
        )
    return tool


def native_command(engine: BatchEngine, settings: SweepSettings, b: int) -> list[str]:
    """llama-batched-bench for batch size b with the engine's own settings (device included)."""
    config = engine.config
    # llama-batched-bench makes b sequence slots: give each the cells ours has (all of them when unified).
    n_ctx = settings.context if config.kv_unified else b * (settings.context // max(settings.batch_sizes))
    return [
        str(native_tool()), "-m", str(engine.model.path), "-c", str(n_ctx), "-b", str(config.n_batch),
        "-ub", str(config.n_ubatch), "-t", str(config.n_threads), "-ngl", _native_gpu_layers(config.gpu_layers),
        "-fa", config.flash_attn, "-ctk", config.cache_type_k, "-ctv", config.cache_type_v,
        "-npp", str(settings.prompt_tokens), "-ntg", str(settings.gen_tokens), "-npl", str(b),
        "-kvu" if config.kv_unified else "-no-kvu", *(["-pps"] if settings.shared_prompt else []),
        *[arg for a in engine.adapters.info for id, scale in engine.adapters.default if a.id == id for arg in ("--lora-scaled", f"{a.path}:{scale}")],
        *(["--rpc", ",".join(config.rpc)] if config.rpc else []),
        *(["-ts", ",".join(f"{x:g}" for x in config.tensor_split)] if config.tensor_split else []),
    ]


def _native_gpu_layers(gpu_layers: int) -> str:
    """The engine's -1 (llama.cpp's C API: every layer) as llama.cpp's tools spell it: there -1 is 'auto' (fit)."""
    return "all" if gpu_layers < 0 else str(gpu_layers)


# llama.cpp's tools print their results through the log thread, which is not flushed at exit
# (llama.cpp issue 22142): a fast run lost its row 17 times in 20 here (the tiny model, B = 32).
# So a short B = 1 run follows ours, keeping the tool alive until our row is out, and is dropped;
# a run that still lost it (4 in 100 at B = 4, all its output) is repeated, after a pause that
# grows, so that a moment of a busy host does not use up every attempt (CI once lost 10 in a row).
NATIVE_ATTEMPTS = 20


def native_run(engine: BatchEngine, settings: SweepSettings, b: int) -> dict:
    """One llama-batched-bench run of batch size b with settings identical to ours; its JSON row."""
    return batched_bench(native_command(engine, settings, b), b)


def batched_bench(command: list[str], b: int) -> dict:
    """llama-batched-bench's JSON row for batch size b, from a command that gives its -npl (and
    no output format), with the B = 1 run after it and the attempts above."""
    command = [*command, "--output-format", "jsonl"]
    command[command.index("-npl") + 1] = f"{b},1"
    for attempt in range(NATIVE_ATTEMPTS):
        done = subprocess.run(command, capture_output=True, text=True)
        rows = [row for line in done.stdout.splitlines() if line.startswith("{") and (row := json.loads(line))["pl"] == b]
        if done.returncode != 0 or rows:
            break
        time.sleep(min(2.0, 0.1 * 2**attempt))
    if done.returncode != 0 or not rows:
        why = done.stderr.strip()[-500:] if done.returncode else f"no result printed in {NATIVE_ATTEMPTS} runs"
        raise LlamabatchError(f"llama-batched-bench failed ({done.returncode}): {why}")
    return rows[0]
