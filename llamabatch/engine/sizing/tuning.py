"""The batch size by measurement (`llamabatch tune`, and `--parallel auto`).

Decode throughput and the time between a sequence's tokens are measured on this machine and
model at growing batch sizes (1, 2, 4, ... up to what memory holds), stopping once throughput
no longer rises by MIN_GAIN. The choice is the size with the highest throughput whose p95
inter-token latency is within a budget (when one is given). Decoding is greedy: sampled rows
add their own cost per row, which the curve does not include. Results are stored, keyed by what
changes them: the machine, the model file, and the engine settings that touch a step's cost.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import llama_cpp
import numpy as np

from ...catalog import model_fingerprint
from ...errors import LlamabatchError
from ..config import EngineConfig
from .planning import pad
from ..sampling.params import SamplingParams

# A larger batch must raise decode throughput by this much to be worth measuring the next one:
# on a CPU the curve flattens once the cores are busy, and each larger size costs more to measure.
MIN_GAIN = 1.05
MAX_BATCH = 256  # llama.cpp's limit on sequences
PROMPT_TOKENS = 32  # per sequence, unless given
GEN_TOKENS = 16  # decode steps measured per batch size
TUNE_DIR_ENV = "LLAMABATCH_TUNE_DIR"


@dataclass(frozen=True)
class TunePoint:
    batch_size: int
    s_tg: float  # generated tokens/s while every sequence decodes
    s_pp: float  # prompt tokens/s of the batch's prefill
    itl_p50_s: float  # the time between a sequence's tokens: one decode step
    itl_p95_s: float


@dataclass(frozen=True)
class Tuning:
    """A measured curve and what it was measured with."""

    key: str
    settings: dict
    prompt_tokens: int
    points: tuple[TunePoint, ...]
    seconds: float  # the measurement's own time

    def choose(self, max_itl_s: float | None = None, job: tuple[float, float] | None = None) -> TunePoint:
        """The point with the highest decode throughput within the latency budget; for a job of
        sequences of (prompt tokens, new tokens) each, the one that runs it soonest, prefill
        counted. When none is within the budget, the smallest batch (the lowest latency there is)."""
        within = [p for p in self.points if max_itl_s is None or p.itl_p95_s <= max_itl_s]
        if not within:
            return min(self.points, key=lambda p: p.batch_size)
        if job is not None:
            prompt, new = job
            return min(within, key=lambda p: prompt / p.s_pp + new / p.s_tg)  # seconds a sequence adds to the job
        return max(within, key=lambda p: p.s_tg)

    def to_dict(self) -> dict:
        return {**asdict(self), "points": [asdict(p) for p in self.points]}

    @classmethod
    def from_dict(cls, data: dict) -> Tuning:
        return cls(data["key"], data["settings"], data["prompt_tokens"], tuple(TunePoint(**p) for p in data["points"]), data["seconds"])


def settings_of(config: EngineConfig, model_path: Path) -> dict:
    """What a measurement depends on: this machine, the model file, and the engine settings that
    change a step's cost (not the context size, not sampling)."""
    return {
        "machine": [platform.machine(), cpu_model(), os.cpu_count(), llama_cpp.llama_print_system_info().decode().strip()],
        "llama_cpp_python": llama_cpp.__version__,
        "model": model_fingerprint(model_path),
        "threads": config.n_threads, "gpu_layers": config.gpu_layers, "n_batch": config.n_batch, "n_ubatch": config.n_ubatch,
        "kv_unified": config.kv_unified, "cache_types": [config.cache_type_k, config.cache_type_v], "flash_attn": config.flash_attn,
        "lora": list(config.lora), "rpc": list(config.rpc), "tensor_split": list(config.tensor_split),
        "deterministic": config.deterministic, "speculative": config.speculative,
    }


def key_of(settings: dict) -> str:
    return hashlib.blake2b(json.dumps(settings, sort_keys=True).encode(), digest_size=10).hexdigest()


def store_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get(TUNE_DIR_ENV) or cache / "llamabatch" / "tune")


def load(settings: dict) -> Tuning | None:
    """The stored measurement for these settings, if one was made; an unreadable file is none."""
    path = store_dir() / f"{key_of(settings)}.json"
    try:
        tuning = Tuning.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return tuning if tuning.settings == settings else None


def save(tuning: Tuning) -> Path:
    folder = store_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{tuning.key}.json"
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(tuning.to_dict(), indent=1))
    temporary.replace(path)  # a reader sees the old file or the new one, never half of one
    return path


def cells_per_sequence(prompt_tokens: int) -> int:
    """The KV cells a measured sequence needs: its prompt and tokens, in llama.cpp's padding."""
    return pad(prompt_tokens + GEN_TOKENS + 1)


def ladder(max_batch: int) -> list[int]:
    """1, 2, 4, ... and max_batch itself."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return [*sizes, max_batch]


def measure(engine, batch_size: int, prompt_tokens: int = PROMPT_TOKENS, gen_tokens: int = GEN_TOKENS, seed: int = 0) -> TunePoint:
    """batch_size sequences of random prompts through the engine; its prefill rate, and
    gen_tokens decode steps timed once every sequence generates."""
    # The first sequences generate while the last prompts are still read (a step shares n_batch
    # between both): they may go on to their context's end, and are cancelled once measured.
    params = SamplingParams(temperature=0, max_tokens=engine.ctx.n_ctx, ignore_eos=True)
    engine.drop_cached_prefixes()
    prompts = np.random.default_rng(seed).integers(0, engine.vocab.n_vocab, size=(batch_size, prompt_tokens)).tolist()
    sequences = engine.submit(prompts, params)
    started = time.perf_counter()
    while any(seq.t_first_token is None for seq in sequences):
        engine.step()
    prefill = time.perf_counter() - started
    steps: list[float] = []
    while len(steps) < gen_tokens and all(seq.finish_reason is None for seq in sequences):
        begun = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - begun)
    for seq in sequences:
        engine.cancel(seq)
    if not steps:
        raise LlamabatchError(f"batch size {batch_size}: no decode step to measure")
    return TunePoint(batch_size, batch_size * len(steps) / sum(steps), batch_size * prompt_tokens / prefill,
                     float(np.percentile(steps, 50)), float(np.percentile(steps, 95)))


def tune(engine, model_path: Path, max_batch: int, *, prompt_tokens: int = PROMPT_TOKENS, gen_tokens: int = GEN_TOKENS,
         progress: Callable[[int, int, str], None] | None = None) -> Tuning:
    """Measure growing batch sizes on an engine with max_batch slots, until throughput stops
    rising. The whole curve is stored, so one measurement serves every latency budget.
    `progress` hears the sizes measured of those on the ladder, and the last one's figures."""
    started = time.perf_counter()
    measure(engine, min(max_batch, 4), prompt_tokens, 4, seed=99)  # warm-up: first allocations, page faults
    points: list[TunePoint] = []
    sizes = ladder(max_batch)
    for b in sizes:
        point = measure(engine, b, prompt_tokens, gen_tokens)
        best = max((p.s_tg for p in points), default=0.0)
        if point.s_tg < best * MIN_GAIN:  # before stopping on it, rule out a burst of load on the host
            point = max(point, measure(engine, b, prompt_tokens, gen_tokens, seed=1), key=lambda p: p.s_tg)
        points.append(point)
        if progress is not None:
            progress(len(points), len(sizes), f"B={b}: {point.s_tg:,.0f} tok/s, p95 {point.itl_p95_s * 1000:.0f} ms between tokens")
        if point.s_tg < best * MIN_GAIN:
            break
    settings = settings_of(engine.config, model_path)
    return Tuning(key_of(settings), settings, prompt_tokens, tuple(points), time.perf_counter() - started)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
