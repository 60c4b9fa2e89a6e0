"""Recurrent and hybrid models: what a reused prefix saves, and what checkpoints and rollbacks cost.

No recurrent or hybrid GGUF ships on PyPI, so the models are written here with random weights in
the shapes of real ones (tests/tiny_model.py's writer): LFM2-350M's (short convolutions beside
attention; llama.cpp keeps rollback snapshots for it) and Granite 4.0 H 350M's (Mamba2 layers with
a 128-wide state beside attention; no snapshots). Their arithmetic, and so their timings, are the
real ones'; their text is noise. Measured on one machine, sides alternating:

  checkpoint   one checkpoint of a sequence's state: its size, and the time to save and restore it
  reuse        a second prompt behind a first one's 1,000-token prefix: tokens it decodes, and its
               time to first token against the same prompt with nothing cached
  prefill      what checkpointing every 64 prompt tokens costs a 1,000-token prefill (shorter chunks)
  drafts       speculative decoding with drafts that are mostly rejected: per rejection, the time to
               roll back (snapshots, or restoring the checkpoint taken before the drafts) and the
               tokens decoded again; per drafting step, the checkpoint taken before it
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from llamabatch import BatchEngine, SamplingParams

from .harness import Spread, alternate, median, paired, progress, tiny_models

SMOKE = ["--shapes", "tiny", "--rounds", "1", "--gen-tokens", "8"]

# (writer arguments) of each shape: real models' sizes, a 32k vocabulary (theirs are 65k and 100k)
SHAPES = {
    "lfm2-350m": dict(arch="lfm2", n_embd=1024, n_layer=16, n_head=16, n_ff=4608, attention_every=3, extra_pieces=32000, f16=True),
    "granite-4.0-h-350m": dict(arch="granitehybrid", n_embd=768, n_layer=32, n_head=12, n_ff=2048, attention_every=8,
                               d_state=128, n_ssm_head=48, extra_pieces=32000, f16=True),
    "tiny": dict(arch="lfm2"),  # the tests' model: --smoke
}
SYSTEM = "You are a careful assistant. Answer briefly, cite the page, and never guess the capital. " * 12  # 1,022 tokens


def arguments(parser) -> None:
    parser.add_argument("--shapes", default="lfm2-350m,granite-4.0-h-350m", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gen-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)


def write_model(shape: str, folder: Path) -> Path:
    arguments = dict(SHAPES[shape])
    arch = arguments.pop("arch")
    progress(f"writing a {shape}-shaped {arch} GGUF")
    return tiny_models().write_tiny_family(folder / f"{shape}.gguf", arch, **arguments)


def engine(model: Path, args, **settings) -> BatchEngine:
    return BatchEngine(model, **{"n_parallel": 4, "n_ctx": 4 * 2048, "n_threads": args.threads, **settings})


def ttft(e: BatchEngine, prompt: str) -> tuple[float, int]:
    """Seconds to a prompt's first token, and the prompt tokens it decoded."""
    before = e.stats.prompt_tokens_evaluated
    started = time.perf_counter()
    [seq] = e.submit([prompt], SamplingParams(temperature=0, max_tokens=1))
    while e.has_work:
        e.step()
    if seq.error:
        raise RuntimeError(seq.error)
    return time.perf_counter() - started, e.stats.prompt_tokens_evaluated - before


def checkpoint_costs(model: Path, args) -> dict:
    """One sequence's state after a 1,000-token prompt saved and put back, as engine.memory does it
    (llama.cpp's PARTIAL_ONLY state: the recurrent layers'; the attention part is cut, not copied)."""
    with engine(model, args, n_parallel=1, n_ctx=4096) as e:
        ttft(e, SYSTEM)
        saves, restores = [], []
        for _ in range(20):
            started = time.perf_counter()
            data = e.ctx.state(0, partial=True)
            saves.append(time.perf_counter() - started)
            started = time.perf_counter()
            if not e.ctx.set_state(0, data, partial=True):
                raise RuntimeError("llama.cpp refused a checkpoint it made")
            restores.append(time.perf_counter() - started)
        return {"bytes": len(data), "save_ms": 1000 * median(saves), "restore_ms": 1000 * median(restores)}


def reuse(model: Path, args) -> dict:
    """TTFT of a prompt behind a cached 1,000-token prefix, against the same prompt cold."""
    first, second = SYSTEM + "Question 1: which page?", SYSTEM + "Question 2: which page?"

    def warm() -> tuple[float, int]:
        with engine(model, args, n_parallel=1, n_ctx=4096) as e:
            ttft(e, first)
            return ttft(e, second)

    def cold() -> tuple[float, int]:
        with engine(model, args, n_parallel=1, n_ctx=4096) as e:
            ttft(e, "warm-up")
            return ttft(e, second)

    runs = alternate({"warm": warm, "cold": cold}, args.rounds, label="reuse")
    return {"evaluated_warm": runs["warm"][0][1], "evaluated_cold": runs["cold"][0][1],
            "ttft_warm_s": Spread.of([t for t, _ in runs["warm"]]), "ttft_cold_s": Spread.of([t for t, _ in runs["cold"]]),
            "speedup": paired([t for t, _ in runs["cold"]], [t for t, _ in runs["warm"]])}


def prefill_price(model: Path, args) -> Spread:
    """A 1,000-token prefill with checkpoints every 64 tokens over one without (checkpoints off)."""
    def timed(**settings) -> float:
        with engine(model, args, n_parallel=1, n_ctx=4096, **settings) as e:
            ttft(e, "warm-up")
            return ttft(e, SYSTEM)[0]

    runs = alternate({"every 64": lambda: timed(), "off": lambda: timed(checkpoint_memory=0)}, args.rounds, label="prefill")
    return paired(runs["every 64"], runs["off"])


def drafts(model: Path, args, draft: Path) -> dict:
    """Speculation by a near copy of the model (most drafts rejected), with every rollback timed."""
    prompts = [f"{SYSTEM[:300]} Question {i}:" for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=args.gen_tokens, ignore_eos=True)
    with engine(model, args, draft_model=draft) as e:
        e.speculator.planner.plan = lambda n_rows, states: [4] * len(states)  # draft every step: measure, not decide
        memory, spent, replayed = e.memory, {"reject": [], "prepare": []}, []
        reject, prepare = memory.reject, memory.prepare_to_reject

        def timed_reject(seq_id: int, n: int, decoded: int) -> int:
            started = time.perf_counter()
            kept = reject(seq_id, n, decoded)
            spent["reject"].append(time.perf_counter() - started)
            replayed.append(n - kept)  # kept tokens it lost with the rejected ones: decoded again
            return kept

        def timed_prepare(*a, **k):
            started = time.perf_counter()
            prepare(*a, **k)
            spent["prepare"].append(time.perf_counter() - started)

        memory.reject, memory.prepare_to_reject = timed_reject, timed_prepare
        e.generate(prompts, params)
        rejections = len(spent["reject"])
        return {
            "snapshots": memory.caps.rollback, "rejections": rejections, "drafted_steps": len(spent["prepare"]),
            "rollback_ms": 1000 * statistics.mean(spent["reject"]) if rejections else 0.0,
            "checkpoint_before_drafts_ms": 1000 * statistics.mean(spent["prepare"]) if spent["prepare"] else 0.0,
            "replayed_tokens_per_rejection": sum(replayed) / rejections if rejections else 0.0,
            "restored": memory.restored, "rolled_back": memory.rolled_back,
            "memory_bytes": e.ctx.kv_bytes,  # KV cache and states, the snapshots' included
        }


def run(args, report) -> None:
    folder = Path(tempfile.mkdtemp(prefix="llamabatch-families-"))
    rows_cp, rows_reuse, rows_drafts = [], [], []
    for shape in args.shapes.split(","):
        model = write_model(shape, folder)
        arch = SHAPES[shape]["arch"]
        draft = tiny_models().write_tiny_family(folder / f"{shape}-draft.gguf", arch, perturb=2.0,
                                                **{k: v for k, v in SHAPES[shape].items() if k != "arch"})
        cp = checkpoint_costs(model, args)
        rows_cp.append([shape, f"{cp['bytes'] / 2**20:.2f}", f"{cp['save_ms']:.2f}", f"{cp['restore_ms']:.2f}"])
        r = reuse(model, args)
        price = prefill_price(model, args)
        rows_reuse.append([shape, r["evaluated_cold"], r["evaluated_warm"], r["ttft_cold_s"], r["ttft_warm_s"], r["speedup"], price])
        d = drafts(model, args, draft)
        with engine(model, args) as plain:  # the same context without speculation: no snapshots kept
            snapshot_bytes = d["memory_bytes"] - plain.ctx.kv_bytes
        rows_drafts.append([shape, f"snapshots of {d['snapshots']} tokens" if d["snapshots"] else "checkpoint", d["rejections"],
                            f"{d['rollback_ms']:.3f}", f"{d['replayed_tokens_per_rejection']:.1f}",
                            f"{d['checkpoint_before_drafts_ms']:.3f}", f"{snapshot_bytes / 2**20:.1f}"])
        report.figure(shape, {"checkpoint": cp, "reuse": r, "prefill_every_64_over_off": price, "drafts": d})
    report.table("A checkpoint of one sequence's state", ["shape", "MiB", "save (ms)", "restore (ms)"], rows_cp,
                 "What each checkpoint kept costs in host memory, and the time to take it (after a chunk that ends at one) "
                 "and to put it back (when a later prompt reuses the prefix).")
    report.table("A prompt behind a cached 1,000-token prefix", [
        "shape", "tokens decoded, cold", "tokens decoded, behind the prefix", "TTFT cold (s)", "TTFT behind (s)", "speedup",
        "1,000-token prefill, checkpoints every 64 / off"], rows_reuse,
        "The prompt is 1,045 tokens, 1,031 of them shared; a plain model would decode 14 of them. "
        "The last column is what taking checkpoints costs the first prompt's prefill.")
    report.table("Rejected drafts", ["shape", "rolled back by", "rejections", "rollback (ms)", "tokens decoded again",
                                     "checkpoint before drafts (ms)", "snapshot memory (MiB)"],
                 rows_drafts, "Per rejection: the time memory.reject took, and the kept tokens the sequence decodes again "
                 "(checkpoint: back to before the drafts; snapshots: none). Per drafting step: the checkpoint taken before it "
                 "where snapshots cannot roll back. Snapshot memory: what llama.cpp allocates for them (4 slots, --draft-max 15).")
