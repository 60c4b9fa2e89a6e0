"""llamabatch's own cost per step: S_TG against native llama-batched-bench on the tests' tiny model.

The tiny model decodes ~100x faster than Gemma 3 270M, so what is not llama_decode (building the
batch, reading logits, sampling, bookkeeping) shows, as a GPU would show it. Each round runs
`llamabatch sweep --baseline native` in a fresh process for each batch size B, so that the engine
has B sequence slots as llama-batched-bench does: within it, llama-batched-bench (built by
scripts/build_native.sh, same llama.cpp) runs beside it with the same settings.
`--before DIR` (another checkout) runs its sweep too, alternating with this one.

Then each step of a greedy run is split into the time inside llama_decode and the rest
(llamabatch's Python: the batch, the logits, sampling, bookkeeping), in a fresh process a round
(and, with --before, the other checkout's split beside it, alternating): the ratio to native is
about native's step over (ours inside llama_decode + the rest), which is why it differs between
machines whose Python and whose matrix kernels differ in speed. The Python per step is also
fitted as a fixed cost plus a cost per sequence, over the batch sizes.

The floor is a loop of bare ctypes calls (BareLoop): what any Python engine over llama-cpp-python
pays a step. It runs against native, and against llamabatch in one process, in short blocks of
steps that alternate: a ratio of two sides timed seconds apart, which a shared host's drift moves
far less than it moves ratios of runs minutes apart. The same blocks time each side outside
llama_decode: the engine's over the bare loop's is the Python llamabatch adds, as it runs, on the
caches a decode has just used (which the bare loop's own reading of the logits pays too).

The same pairs of blocks run again with llama_decode a stand-in (stand_in_decode): writing
nothing, each side's own Python on warm caches, as beside a GPU's decode, which leaves the host's
caches alone; writing EVICT_MB first, the same on caches a CPU decode has filled with its own
data. The in-place figures above follow the second: most of a step's time outside llama_decode on
a CPU is its code and data read back from memory, in the bare loop as in the engine.

`--instructions` counts instead of timing (valgrind's callgrind): the instructions a step of B
sequences executes with llama_decode replaced by a C call that returns at once, so every one is
llamabatch's (and the binding's). A count does not change with the host's load, where a shared
2-core host's timings of a few microseconds spread by 2x between runs; it is not a time either.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import inspect
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import llama_cpp
import numpy as np

from llamabatch import BatchEngine, SamplingParams
from llamabatch.engine import batch_engine
from llamabatch.measure.sweep import SweepSettings, native_run

from .harness import ROOT, Spread, alternate, cli, json_lines, median, model_path, paired, run as run_command, tiny_model

SMOKE = ["--rounds", "1", "--batch-sizes", "1,4", "--gen-tokens", "8"]
FLOOR_BLOCK = 16  # steps a side runs before the other runs as many (against_floor)
SLOTS = (1, 64, 256)  # sequence slots of the context one sequence decodes in (the slot-pair check)
# Twice the L3 of the EPYC the benchmarks run on (16 MiB): a stand-in decode that writes this much
# leaves the caches as a tiny-model decode of 64 rows does (its attention's masks and scores).
EVICT_MB = 32


def prompt_token(s: int, p: int) -> int:
    """Token p of sequence s's prompt: the prompts differ, so no prefix is shared, and every side
    (engine, bare loop, counted loop) reads the same ones."""
    return 1 + (s * 7 + p) % 200


def prompts(b: int, n: int) -> list[list[int]]:
    return [[prompt_token(s, p) for p in range(n)] for s in range(b)]


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="GGUF path or catalog name (default: the tests' tiny model)")
    parser.add_argument("--before", type=Path, default=None, help="another checkout to compare with")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kv-unified", action=argparse.BooleanOptionalAction, default=None,
                        help="the KV layout of both sides (default: the engine's, unified)")
    parser.add_argument("--instructions", action="store_true",
                        help="count a step's instructions outside llama_decode under callgrind instead of timing")


class BareLoop:
    """The floor of any Python engine over llama-cpp-python: B greedy rows stepped by bare ctypes
    calls (decode B rows, read the logits, one numpy argmax, write the tokens and positions back;
    no bookkeeping at all), in a context of its own that nothing else steps. The rows start from
    the prompts the benchmark's engine reads, so both decode at the same positions."""

    def __init__(self, engine: BatchEngine, b: int, prompt_tokens: int) -> None:
        self.ctx, self.n_vocab, self.b, self.prompt_tokens = engine.ctx.handle, engine.vocab.n_vocab, b, prompt_tokens
        self.n_batch = engine.ctx.n_batch
        size = max(b, self.n_batch)
        self.batch = llama_cpp.llama_batch_init(size, 0, 1)
        self.token, self.pos, self.logits = (np.ctypeslib.as_array(a, shape=(size,)) for a in (self.batch.token, self.batch.pos, self.batch.logits))

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)

    def prefill(self, lengths: list[int] | None = None) -> None:
        """The memory cleared, row s reads `lengths[s]` tokens (default: the prompt; more where
        the engine's sequence has decoded tokens since), whole rows a decode up to n_batch; each
        row is then due its next step at the position after them. The KV cache then holds as
        many cells as the engine's, which the attention's cost follows."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        lengths = lengths or [self.prompt_tokens] * self.b
        if max(lengths) > self.n_batch:
            raise ValueError(f"a bare row of {max(lengths)} tokens does not fit n_batch ({self.n_batch})")
        batch, chunk = self.batch, []
        for s, n in enumerate(lengths):
            if len(chunk) + n > self.n_batch:
                self._decode_prefill(chunk)
                chunk = []
            chunk += [(s, p, p == n - 1) for p in range(n)]
        self._decode_prefill(chunk)
        for s in range(self.b):
            batch.n_seq_id[s], batch.seq_id[s][0] = 1, s
        self.token[: self.b], self.pos[: self.b], self.logits[: self.b] = 1, lengths, 1
        batch.n_tokens = self.b

    def _decode_prefill(self, rows: list[tuple[int, int, bool]]) -> None:
        batch = self.batch
        for i, (s, p, last) in enumerate(rows):
            self.token[i], self.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], self.logits[i] = prompt_token(s, p), p, 1, s, last
        batch.n_tokens = len(rows)
        if llama_cpp.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("the bare loop's prefill did not decode")

    def steps(self, n: int) -> float:
        """n steps of the B rows; their seconds."""
        ctx, batch, b, n_vocab, token, pos = self.ctx, self.batch, self.b, self.n_vocab, self.token, self.pos
        started = time.perf_counter()
        for _ in range(n):
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("the bare loop's step did not decode")
            address = ctypes.addressof(llama_cpp.llama_get_logits(ctx).contents)
            rows = np.frombuffer((ctypes.c_float * (b * n_vocab)).from_address(address), np.float32).reshape(b, n_vocab)
            token[:b] = rows.argmax(axis=1)
            pos[:b] += 1
        return time.perf_counter() - started


def bare_loop(model: str, b: int, args) -> list[float]:
    """The floor's S_TG over native's, a ratio each round, native run beside it in the same
    context settings (the engine's, whose context the loop steps; the engine itself never steps)."""
    settings = SweepSettings(batch_sizes=(b,), prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens)
    ratios = []
    with BatchEngine(model, n_parallel=b, n_ctx=settings.context, n_threads=args.threads, kv_unified=args.kv_unified) as engine:
        bare = BareLoop(engine, b, args.prompt_tokens)
        try:
            for _ in range(args.rounds):
                theirs = native_run(engine, settings, b)["speed_tg"]
                bare.prefill()
                ratios.append(b * args.gen_tokens / bare.steps(args.gen_tokens) / theirs)
        finally:
            bare.close()
    return ratios


@dataclass(frozen=True)
class FloorPair:
    """A pair of blocks of against_floor: the floor's seconds over ours (llamabatch's S_TG over the
    floor's), and each side's µs a step outside llama_decode."""

    ratio: float
    ours_outside: float
    floor_outside: float


def against_floor(model: str, b: int, args) -> list[FloorPair]:
    """llamabatch's S_TG over the floor's, in one process: B greedy sequences (PP, TG as the
    sweep, answered whole) stepped by an engine, and the bare loop in a second context of the
    same settings, in blocks of FLOOR_BLOCK steps that alternate (which goes first alternating
    too), so that the host's drift, slow or fast, falls on both sides of each pair alike. A
    FloorPair a pair of blocks, every round's. Only steps of all B sequences are timed: prompts
    read over several steps start decoding up to a few steps apart, so the sequences may take
    FLOOR_BLOCK tokens more than TG, and the steps after the timed ones (the first to start
    ending first) run untimed."""
    settings = SweepSettings(batch_sizes=(b,), prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens + FLOOR_BLOCK)
    sizes = dict(n_parallel=b, n_ctx=settings.context, n_threads=args.threads, kv_unified=args.kv_unified)
    params = SamplingParams(temperature=0, max_tokens=settings.gen_tokens, ignore_eos=True)
    pairs: list[FloorPair] = []
    with BatchEngine(model, **sizes) as engine, BatchEngine(model, **sizes) as host, decode_clock() as inside:
        bare = BareLoop(host, b, args.prompt_tokens)
        ours_steps = partial(engine_steps, engine)
        try:
            for _ in range(args.rounds):
                engine.drop_cached_prefixes()
                sequences = engine.submit(prompts(b, args.prompt_tokens), params, streamed=False)
                while any(s.t_first_token is None for s in sequences):  # the prefills, not timed
                    engine.step()
                # Each row as long as its sequence: a sequence that began decoding steps before the
                # last holds as many more cells, which a step's attention reads.
                bare.prefill([args.prompt_tokens + s.n_generated - 1 for s in sequences])
                for first in range(1, args.gen_tokens, FLOOR_BLOCK):  # the prefill sampled each first token
                    n = min(FLOOR_BLOCK, args.gen_tokens - first)
                    ours, theirs = blocks(ours_steps, bare.steps, n, inside, theirs_first=len(pairs) % 2 == 1)
                    pairs.append(FloorPair(theirs[0] / ours[0], ours[1], theirs[1]))
                if any(s.finish_reason is not None for s in sequences):
                    raise RuntimeError(f"a sequence ended within the timed steps: prompts began decoding over {FLOOR_BLOCK} steps apart")
                while engine.has_work:
                    engine.step()
        finally:
            bare.close()
    return pairs


def block(steps: Callable[[int], float], n: int, inside: list[float]) -> tuple[float, float]:
    """n steps by `steps` (which returns their seconds) under decode_clock's `inside`: the
    seconds, and µs a step outside llama_decode."""
    inside[0] = 0.0
    seconds = steps(n)
    return seconds, (seconds - inside[0]) / n * 1e6


def blocks(ours: Callable[[int], float], theirs: Callable[[int], float], n: int, inside: list[float],
           theirs_first: bool) -> tuple[tuple[float, float], tuple[float, float]]:
    """A block of n steps a side (block()'s values, ours then theirs), the side that goes first
    alternating from pair to pair, so that the host's drift falls on both alike."""
    if theirs_first:
        theirs_block = block(theirs, n, inside)
        return block(ours, n, inside), theirs_block
    ours_block = block(ours, n, inside)
    return ours_block, block(theirs, n, inside)


@contextlib.contextmanager
def decode_clock() -> Iterator[list[float]]:
    """llama_decode timed while in the block: [seconds inside it, calls], added up for every caller
    that looks it up in llama_cpp's module at each call (the engine's Context and BareLoop do)."""
    inside = [0.0, 0]
    real = llama_cpp.llama_decode

    def timed(ctx, batch):
        started = time.perf_counter()
        try:
            return real(ctx, batch)
        finally:
            inside[0] += time.perf_counter() - started
            inside[1] += 1

    llama_cpp.llama_decode = timed
    try:
        yield inside
    finally:
        llama_cpp.llama_decode = real


def engine_steps(engine: BatchEngine, n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        engine.step()
    return time.perf_counter() - started


def stand_in_decode(evict_mb: float = 0) -> Callable[[object, object], int]:
    """A stand-in for llama_decode: a C call that returns 0 (the logits stay the last real
    decode's), after writing `evict_mb` of memory, as a CPU decode's own traffic does. Writing
    nothing leaves the host's caches as a GPU's decode leaves them."""
    absolute = ctypes.CDLL(None).abs
    if not evict_mb:
        return lambda ctx, batch: absolute(0)
    scratch = np.zeros(int(evict_mb * 2**20) // 8)

    def decode(ctx, batch) -> int:
        np.add(scratch, 1.0, out=scratch)
        return absolute(0)

    return decode


def outside_stand_in(model: str, b: int, args, evict_mb: float) -> list[tuple[float, float]]:
    """µs a step outside llama_decode, (engine, bare loop) a pair of blocks each, as against_floor
    pairs them, with llama_decode a stand-in (stand_in_decode(evict_mb)) for args.rounds *
    gen_tokens steps a side: each side's own Python, on warm caches (nothing written) or on
    caches a decode has emptied. Only the prefills decode: after them the positions advance
    with nothing stored."""
    steps = args.rounds * args.gen_tokens
    sizes = dict(n_parallel=b, n_ctx=b * (args.prompt_tokens + steps + 2 * FLOOR_BLOCK), n_threads=args.threads, kv_unified=args.kv_unified)
    params = SamplingParams(temperature=0, max_tokens=steps + 2 * FLOOR_BLOCK, ignore_eos=True)
    pairs: list[tuple[float, float]] = []
    with BatchEngine(model, **sizes) as engine, BatchEngine(model, **sizes) as host:
        ours_steps = partial(engine_steps, engine)
        sequences = submit_as_the_sweep(engine, prompts(b, args.prompt_tokens), params)
        while any(s.t_first_token is None for s in sequences):
            engine.step()
        bare, real = BareLoop(host, b, args.prompt_tokens), llama_cpp.llama_decode
        try:
            bare.prefill()
            llama_cpp.llama_decode = stand_in_decode(evict_mb)
            with decode_clock() as inside:
                for first in range(0, steps, FLOOR_BLOCK):
                    n = min(FLOOR_BLOCK, steps - first)
                    ours, theirs = blocks(ours_steps, bare.steps, n, inside, theirs_first=len(pairs) % 2 == 1)
                    pairs.append((ours[1], theirs[1]))
            ended = [s.finish_reason for s in sequences if s.finish_reason is not None]
            if ended:  # fewer rows than B were timed
                raise RuntimeError(f"{len(ended)} of {b} sequences ended within the stand-in's steps (first: {ended[0]})")
        finally:
            llama_cpp.llama_decode = real
            bare.close()
    return pairs


def step_split(model: str, b: int, args, slots: int | None = None, native_too: bool = True) -> tuple[float, float, float | None]:
    """Microseconds per decode step of B greedy sequences (PP, TG as the sweep) in an engine of
    `slots` sequence slots (default B): inside llama_decode, outside it, and (`native_too`)
    native's whole step, llama-batched-bench run just before, as the host's speed drifts."""
    slots = slots or b
    settings = SweepSettings(batch_sizes=(slots,), prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens)
    context = settings.context
    with BatchEngine(model, n_parallel=slots, n_ctx=context, n_threads=args.threads, kv_unified=args.kv_unified) as engine:
        params = SamplingParams(temperature=0, max_tokens=args.gen_tokens, ignore_eos=True)
        engine.generate(prompts(b, args.prompt_tokens), params)  # warm
        native_step = b / native_run(engine, replace(settings, batch_sizes=(b,)), b)["speed_tg"] * 1e6 if native_too else None
        engine.drop_cached_prefixes()
        sequences = submit_as_the_sweep(engine, prompts(b, args.prompt_tokens), params)
        while any(s.t_first_token is None for s in sequences):  # the prefill, not counted
            engine.step()
        with decode_clock() as inside:
            started = time.perf_counter()
            while engine.has_work:
                engine.step()
            wall = time.perf_counter() - started
    steps = inside[1]
    return inside[0] / steps * 1e6, (wall - inside[0]) / steps * 1e6, native_step


def submit_as_the_sweep(engine: BatchEngine, texts: list[list[int]], params: SamplingParams) -> list:
    """The prompts submitted as the sweep submits them: answered whole (no one reads their tokens
    as they come). A checkout from before answers could be whole (--before one as old as issue
    52's dfbf8c1) streams every token, as its sweep then did."""
    if "streamed" in inspect.signature(engine.submit).parameters:
        return engine.submit(texts, params, streamed=False)
    return engine.submit(texts, params)


@contextlib.contextmanager
def tree_first(tree: Path) -> Iterator[tuple[str, str]]:
    """A folder whose `llamabatch` is `tree`'s, and a PYTHONPATH that puts it first (before this
    checkout, which holds the benchmarks): for a process that runs another checkout's engine."""
    with tempfile.TemporaryDirectory() as shim:
        (Path(shim) / "llamabatch").symlink_to(tree / "llamabatch")
        yield shim, os.pathsep.join([shim, str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


def in_tree(tree: Path, call: str, args) -> list:
    """`call`, a call of this checkout's benchmarks.overhead whose `args` are the run's, in a fresh
    process whose llamabatch is `tree`'s (a shim folder puts that tree's package first on the
    path); its value, a JSON list."""
    with tree_first(tree) as (shim, path):
        settings = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))}
        code = f"import argparse, json; from benchmarks import overhead; args = argparse.Namespace(**{settings!r}); print(json.dumps(overhead.{call}))"
        _, out = run_command([sys.executable, "-c", code], env={"PYTHONPATH": path}, cwd=shim)
    return json.loads([line for line in out.splitlines() if line.startswith("[")][-1])


def split_in(tree: Path, model: str, b: int, args, native_too: bool) -> tuple[float, float, float | None]:
    """step_split with `tree`'s llamabatch (in_tree)."""
    return tuple(in_tree(tree, f"step_split({model!r}, {b}, args, native_too={native_too})", args))


def warm_in(tree: Path, model: str, b: int, args) -> list[float]:
    """The engine's side of outside_stand_in, warm, with `tree`'s llamabatch (in_tree): one
    round of blocks."""
    return [ours for ours, _ in in_tree(tree, f"outside_stand_in({model!r}, {b}, args, 0)", argparse.Namespace(**{**vars(args), "rounds": 1}))]


def no_decode_loop(model: str, b: int, steps: int, streamed: bool, room: int) -> None:
    """B greedy sequences stepped `steps` times after their prefill, each llama_decode replaced by
    a C call that returns 0 (the logits stay the last real decode's): only the step's own work is
    left. What instructions_per_step counts. `streamed`: their tokens are read as they come (an
    event each), else only their ends. `room`: steps the context has room for, the same for every
    loop length (a larger context costs more to set up: it would count as the steps' work)."""
    # The engine publishes its snapshot every 25 ms: a step under callgrind takes about that, one
    # on the host a thousandth of it, so counted steps would publish each time where real ones don't.
    batch_engine.PUBLISH_EVERY_S = math.inf
    with BatchEngine(model, n_parallel=b, n_ctx=b * (64 + room), n_threads=1) as engine:
        params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)
        sequences = engine.submit(prompts(b, 32), params, streamed=streamed)
        while any(s.t_first_token is None for s in sequences):
            engine.step()
        real, llama_cpp.llama_decode = llama_cpp.llama_decode, stand_in_decode()
        try:
            for _ in range(steps):
                engine.step()
        finally:
            llama_cpp.llama_decode = real
        ended = [s for s in sequences if s.finish_reason is not None]
        if ended:
            raise RuntimeError(f"a sequence ended during the counted steps: {ended[0].result()}")


def instructions_per_step(tree: Path, model: str, b: int, streamed: bool, steps: tuple[int, int] = (100, 300)) -> float:
    """Instructions of one no-decode step of B sequences with `tree`'s llamabatch: callgrind's
    totals for two loop lengths, differenced (start-up, loading and prefill cancel out)."""
    totals = []
    with tree_first(tree) as (shim, path):
        for n in steps:
            out = Path(shim) / f"callgrind.{n}"
            code = f"from benchmarks.overhead import no_decode_loop; no_decode_loop({model!r}, {b}, {n}, {streamed}, {max(steps)})"
            run_command(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c", code],
                        env={"PYTHONPATH": path, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}, cwd=shim)
            totals.append(int(next(line for line in out.read_text().splitlines() if line.startswith("totals:")).split()[1]))
    return (totals[1] - totals[0]) / (steps[1] - steps[0])


def count(args, report, trees: dict[str, Path], sizes: list[int]) -> None:
    """--instructions: each tree's instructions per step at each B, its sequences streamed and
    answered whole (only their ends read), and the fits."""
    sides = {f"{name} {mode}": (tree, mode == "streamed") for name, tree in trees.items() for mode in ("streamed", "whole")}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(model_path(args.model)) if args.model else str(tiny_model(Path(tmp)))
        counts = {side: {b: instructions_per_step(tree, model, b, streamed) for b in sizes} for side, (tree, streamed) in sides.items()}
    fits = {side: per_sequence(points) for side, points in counts.items()}
    for side, (fixed, each) in fits.items():
        report.figure(f"instructions_fixed_{side.replace(' ', '_')}", round(fixed))
        report.figure(f"instructions_per_sequence_{side.replace(' ', '_')}", round(each))
    ratios = [f"{mode}: after / before" for mode in ("streamed", "whole")] if len(trees) > 1 else []
    report.table(
        "Instructions a step outside llama_decode (callgrind; llama_decode a C call returning at once)",
        ["B", *sides, *ratios],
        [[b, *(round(counts[side][b]) for side in sides),
          *(counts[f"llamabatch {mode}"][b] / counts[f"before {mode}"][b] for mode in ("streamed", "whole") if ratios)]
         for b in sizes] + [["fit: fixed + per sequence", *(f"{fixed:,.0f} + {each:,.0f} B" for fixed, each in fits.values()),
                             *([""] * len(ratios))]],
        "Greedy sequences, one thread, PYTHONHASHSEED 0: the same count on any load. Instructions, not time: "
        "a Python bytecode and a C loop differ in instructions per nanosecond. Streamed: each token's event is "
        "built; whole: only each sequence's end is read (generate(), job lines, a server's answers given whole).",
    )


def own_python(report, pairs: dict[int, list[FloorPair]]) -> None:
    """The floor's blocks timed outside llama_decode, each side: llamabatch's own Python as it runs
    is the engine's time there over the bare loop's, a pair of blocks each; and its fit."""
    added = {b: [p.ours_outside - p.floor_outside for p in pairs[b]] for b in pairs}
    fixed, each = per_sequence({b: median(added[b]) for b in added})
    report.figure("own_python_us_fixed", round(fixed, 2))
    report.figure("own_python_us_per_sequence", round(each, 3))
    for b in added:
        report.figure(f"own_python_us_b{b}", Spread.of(added[b]))
    report.table(
        "Outside llama_decode in one process: the engine against the bare loop (µs a step)",
        ["B", "llamabatch", "bare loop", "llamabatch over the bare loop", "over it, per sequence"],
        [[b, Spread.of([p.ours_outside for p in pairs[b]]), Spread.of([p.floor_outside for p in pairs[b]]),
          Spread.of(added[b]), median(added[b]) / b] for b in pairs] + [["fit: fixed + per sequence", "", "", f"{fixed:.1f} + {each:.2f} B", ""]],
        "The floor's blocks, each side's wall time less its time inside llama_decode. Both sides read the logits, take "
        "an argmax and write the tokens back on caches the decode has just used; the difference, a pair of blocks each, "
        "is what llamabatch's Python adds to that, as it runs. Medians (lowest–highest) of the pairs; the fit is least "
        "squares over the batch sizes' medians.",
    )


def without_decode(report, stand_ins: dict[int, dict[float, list[tuple[float, float]]]], pairs: dict[int, list[FloorPair]]) -> None:
    """Each side's µs a step outside llama_decode with the decode a stand-in, warm and after
    EVICT_MB written, beside the same in place (the floor's blocks); and their fits."""
    columns = {
        "llamabatch, warm": {b: [x[0] for x in stand_ins[b][0]] for b in pairs},
        "bare loop, warm": {b: [x[1] for x in stand_ins[b][0]] for b in pairs},
        f"llamabatch, {EVICT_MB} MB written": {b: [x[0] for x in stand_ins[b][EVICT_MB]] for b in pairs},
        f"bare loop, {EVICT_MB} MB written": {b: [x[1] for x in stand_ins[b][EVICT_MB]] for b in pairs},
        "llamabatch, decoding": {b: [p.ours_outside for p in pairs[b]] for b in pairs},
        "bare loop, decoding": {b: [p.floor_outside for p in pairs[b]] for b in pairs},
    }
    fits = {name: per_sequence({b: median(times) for b, times in column.items()}) for name, column in columns.items()}
    for name, (fixed, each) in fits.items():
        key = name.replace(", ", "_").replace(" ", "_")
        report.figure(f"outside_us_fixed_{key}", round(fixed, 2))
        report.figure(f"outside_us_per_sequence_{key}", round(each, 3))
    report.table(
        "Outside llama_decode with the decode a stand-in, in one process (µs a step)",
        ["B", *columns],
        [[b, *(Spread.of(column[b]) for column in columns.values())] for b in pairs]
        + [["fit: fixed + per sequence", *(f"{fixed:.1f} + {each:.2f} B" for fixed, each in fits.values())]],
        "llama_decode replaced by a C call returning at once, in blocks alternating between the engine and the bare "
        f"loop as the floor's: warm, each side's own Python on caches nothing else used (as beside a GPU's decode); "
        f"{EVICT_MB} MB written, the stand-in first writes twice this host's L3, as a CPU decode of many rows does. "
        "Decoding: the floor's blocks in place. Where the written and the decoding columns agree, what a step costs "
        "outside llama_decode beyond the warm figure is its data and code read back from memory. Medians "
        "(lowest–highest) of the blocks; the fit is least squares over the batch sizes' medians.",
    )


def warm_before_after(report, warm: dict[int, dict[str, list[list[float]]]]) -> None:
    """--before: each checkout's own Python on warm caches (outside_stand_in, nothing written), a
    process a round, alternating; and their fits."""
    blocks = {b: {name: [us for run in runs for us in run] for name, runs in sides.items()} for b, sides in warm.items()}
    names = list(next(iter(blocks.values())))
    fits = {name: per_sequence({b: median(blocks[b][name]) for b in blocks}) for name in names}
    for name, (fixed, each) in fits.items():
        report.figure(f"warm_python_us_fixed_{name}", round(fixed, 2))
        report.figure(f"warm_python_us_per_sequence_{name}", round(each, 3))
    report.table(
        "Outside llama_decode on warm caches (the decode a stand-in writing nothing), each checkout in its own process, alternating (µs a step)",
        ["B", *names, "after / before"],
        [[b, *(Spread.of(blocks[b][name]) for name in names), median(blocks[b]["llamabatch"]) / median(blocks[b]["before"])] for b in blocks]
        + [["fit: fixed + per sequence", *(f"{fixed:.1f} + {each:.2f} B" for fixed, each in fits.values()),
            f"{fits['llamabatch'][0] / fits['before'][0]:.2f} + {fits['llamabatch'][1] / fits['before'][1]:.2f} B"]],
        "Medians (lowest–highest) of the blocks; the ratio is of the medians, and of the fits' parts in the last row.",
    )


def per_sequence(points: dict[int, float]) -> tuple[float, float]:
    """The Python per step fitted (least squares) as fixed + per_sequence * B: (fixed, per sequence) in µs."""
    sizes = sorted(points)
    if len(sizes) < 2:
        return points[sizes[0]], 0.0
    slope, intercept = np.polyfit(sizes, [points[b] for b in sizes], 1)
    return float(intercept), float(slope)


def run(args, report) -> None:
    trees = {"llamabatch": ROOT} if args.before is None else {"before": args.before.resolve(), "llamabatch": ROOT}
    sizes = list(map(int, args.batch_sizes.split(",")))
    if args.instructions:
        count(args, report, trees, sizes)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = str(model_path(args.model)) if args.model else str(tiny_model(Path(tmp)))

        def sweep(tree: Path):
            # A sweep a batch size, so that the engine has B sequence slots, as llama-batched-bench
            # has for B: llama.cpp checks every pair of slots at each decode (2 us a step for 64).
            commands = [cli("sweep", "--model", model, "--batch-sizes", b, "--baseline", "native", "--json", "--threads", args.threads,
                            "--prompt-tokens", args.prompt_tokens, "--gen-tokens", args.gen_tokens,
                            *({True: ["--kv-unified"], False: ["--no-kv-unified"]}.get(args.kv_unified, []))) for b in sizes]
            path = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])  # this tree's llamabatch first
            return lambda: {p["batch_size"]: p for command in commands
                            for p in json_lines(run_command(command, env={"PYTHONPATH": path}, cwd=tree)[1])}

        runs = alternate({name: sweep(tree) for name, tree in trees.items()}, args.rounds, label="sweeps")
        splits = {b: alternate({name: (lambda tree=tree, name=name: split_in(tree, model, b, args, native_too=name == "llamabatch"))
                                for name, tree in trees.items()}, args.rounds, label=f"step split B={b}") for b in sizes}
        split = {b: splits[b]["llamabatch"] for b in sizes}
        floor = {b: bare_loop(model, b, args) for b in sizes}
        ours_over_floor = {b: against_floor(model, b, args) for b in sizes}
        stand_ins = {b: {mb: outside_stand_in(model, b, args, mb) for mb in (0, EVICT_MB)} for b in sizes}
        warm = {b: alternate({name: partial(warm_in, tree, model, b, args) for name, tree in trees.items()}, args.rounds, label=f"warm B={b}")
                for b in sizes} if len(trees) > 1 else None
        by_slots = {n: [] for n in SLOTS}
        for _ in range(args.rounds):
            for n in SLOTS:
                by_slots[n].append(step_split(model, 1, args, slots=n, native_too=False)[0])
    rows = []
    for b in sizes:
        native_s_tg = median([r[b]["native_s_tg"] for side in runs.values() for r in side])
        row = [b, *(median([r[b]["s_tg"] for r in runs[name]]) for name in trees), native_s_tg]
        row += [paired([r[b]["s_tg"] for r in runs[name]], [r[b]["native_s_tg"] for r in runs[name]]) for name in trees]
        rows.append(row)
        report.figure(f"ratio_b{b}", row[-1])
    report.table(
        f"S_TG (tokens/s), PP {args.prompt_tokens}, TG {args.gen_tokens}, {args.threads} threads, "
        f"{ {True: 'unified KV', False: 'per-sequence KV', None: 'the default KV layout (unified)'}[args.kv_unified]}",
        ["B", *(f"{n} S_TG" for n in trees), "native S_TG", *(f"{n} / native" for n in trees)], rows,
        f"Medians of {args.rounds} rounds; a ratio is the median (lowest–highest) of the rounds' S_TG / native S_TG, "
        "native measured in the same process beside each batch size.",
    )
    report.table(
        "Where a step goes (µs per decode step, this checkout, in process)",
        ["B", "inside llama_decode", "outside: llamabatch's Python", "native step (from its S_TG)", "outside per sequence"],
        [[b, Spread.of([x[0] for x in split[b]]), Spread.of([x[1] for x in split[b]]), Spread.of([x[2] for x in split[b]]),
          median([x[1] for x in split[b]]) / b] for b in sizes],
        "Ours is the sum of the first two columns. The native step is B / native S_TG, of llama-batched-bench "
        "run just before each of ours. Sequences answered whole (no one reads their tokens as they come), as the "
        "sweep's and llama-batched-bench's.",
    )
    for b in sizes:
        report.figure(f"python_us_per_step_b{b}", Spread.of([x[1] for x in split[b]]))
    fits = {name: per_sequence({b: median([x[1] for x in splits[b][name]]) for b in sizes}) for name in trees}
    for name, (fixed, each) in fits.items():
        report.figure(f"python_us_fixed_{name}", round(fixed, 2))
        report.figure(f"python_us_per_sequence_{name}", round(each, 3))
    report.table(
        "llamabatch's Python per step (µs outside llama_decode), each checkout in its own process, alternating",
        ["B", *(f"{name}" for name in trees), *(["after / before"] if len(trees) > 1 else [])],
        [[b, *(Spread.of([x[1] for x in splits[b][name]]) for name in trees),
          *([paired([x[1] for x in splits[b]["llamabatch"]], [x[1] for x in splits[b]["before"]])] if len(trees) > 1 else [])]
         for b in sizes] + [["fit: fixed + per sequence", *(f"{fixed:.1f} + {each:.2f} B" for fixed, each in fits.values()),
                             *([""] if len(trees) > 1 else [])]],
        "Medians (lowest–highest) of the rounds; the fit is least squares over the batch sizes' medians.",
    )
    report.table(
        "The floor: a loop of bare ctypes calls, against native and against llamabatch (S_TG ratios)",
        ["B", "bare loop / native", "llamabatch / native (first table)", "llamabatch / bare loop (one process)"],
        [[b, Spread.of(floor[b]), rows[k][-1], Spread.of([p.ratio for p in ours_over_floor[b]])] for k, b in enumerate(sizes)],
        "Each step of the bare loop decodes B rows, reads the logits and takes one numpy argmax, nothing else: what "
        "llama-cpp-python's ctypes calls and numpy cost a step already, before any engine. Against native it runs in "
        "the engine's context, native beside it each round. Against llamabatch it runs in a second context of the same "
        f"settings in the engine's process, in blocks of {FLOOR_BLOCK} steps alternating with the engine's (the same "
        "positions on both sides): median (lowest–highest) of the blocks' ratios, so a drift of the host's speed falls on "
        "both sides alike.",
    )
    for b in sizes:
        report.figure(f"bare_loop_ratio_b{b}", Spread.of(floor[b]))
        report.figure(f"llamabatch_over_bare_loop_b{b}", Spread.of([p.ratio for p in ours_over_floor[b]]))
    own_python(report, ours_over_floor)
    without_decode(report, stand_ins, ours_over_floor)
    if warm:
        warm_before_after(report, warm)
    report.table(
        "One sequence's llama_decode against the sequence slots of its context (µs per step)",
        ["slots (--parallel)", "inside llama_decode", f"over {SLOTS[0]} slot"],
        [[n, Spread.of(by_slots[n]), paired(by_slots[n], by_slots[SLOTS[0]])] for n in SLOTS],
        "llama.cpp checks every pair of a context's sequence slots at each decode (llama_batch_allocr::init), "
        "so a step's fixed cost grows with the square of --parallel, in llama-server as in llamabatch.",
    )
