"""Is the batch size `llamabatch tune` picks the fastest, and is a job's estimate right?

choice    `llamabatch tune --again` (timed), then the same prompts through the engine at each
          --sizes batch size, as `run` drives it (greedy, EOS ignored): generated tokens/s over
          the whole run and the p95 time between a sequence's tokens (a decode step); the
          tuned choice's throughput against the best of the sizes, with and without --max-itl
estimate  a --lines job (one prompt a line, --job-tokens each, EOS ignored) through
          `llamabatch batch --estimate`, then the job itself with --parallel auto: the
          estimate against the wall time
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

from llamabatch import BatchEngine, SamplingParams
from llamabatch.engine.config import parse_duration
from llamabatch.engine.sizing.tuning import Tuning

from .batch import FORMS, SUBJECTS
from .harness import cli, json_lines, progress, run as run_command, tiny_model

SMOKE = ["--model", "tiny", "--sizes", "2,4", "--prompts", "8", "--max-tokens", "4", "--lines", "20", "--job-tokens", "4"]


def arguments(parser) -> None:
    parser.add_argument("--parts", default="choice,estimate")
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--sizes", default="4,8,16,32,64", help="choice: batch sizes measured independently")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-itl", default="150ms")
    parser.add_argument("--lines", type=int, default=2000, help="estimate: requests in the job")
    parser.add_argument("--job-tokens", type=int, default=16)


def prompts(n: int) -> list[str]:
    return [FORMS[i % len(FORMS)].format(SUBJECTS[i // len(FORMS) % len(SUBJECTS)]) + f" ({i})" for i in range(n)]


def through_engine(model: str | None, b: int, texts: list[str], max_tokens: int) -> tuple[float, float]:
    """Generated tokens/s over the whole run, and the p95 decode step while every slot is busy."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with BatchEngine(model, n_parallel=b, n_ctx=b * 256) as engine:  # as tune's engine: 256 cells a sequence
        engine.generate(texts[:b], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
        engine.submit(texts, params)
        steps, generated, started = [], 0, time.perf_counter()
        while engine.has_work:
            busy = len(engine.scheduler.running) == b
            begun = time.perf_counter()
            events = engine.step()
            if busy:
                steps.append(time.perf_counter() - begun)
            generated += sum(1 for e in events if e.token is not None)
        wall = time.perf_counter() - started
    return generated / wall, float(np.percentile(steps, 95)) if steps else 0.0


def choice(args, report, model: str | None) -> None:
    budget = parse_duration(args.max_itl)
    tuned_wall, out = run_command(cli("tune", *(["-m", model] if model else []), "--again", "--json"))
    tuned = json_lines(out)[-1]
    chosen_within = Tuning.from_dict(tuned).choose(budget).batch_size
    texts = prompts(args.prompts)
    measured = {}
    for b in map(int, args.sizes.split(",")):
        progress(f"choice: B = {b}")
        measured[b] = through_engine(model, b, texts, args.max_tokens)
    rows = [[b, round(s, 1), round(p95 * 1000, 1)] for b, (s, p95) in measured.items()]
    report.table(f"The same {args.prompts} prompts × {args.max_tokens} tokens at each batch size (the engine as `run` drives it)",
                 ["B", "tokens/s", "p95 between tokens (ms)"], rows)
    best = max(s for s, _ in measured.values())
    fits = [s for s, p95 in measured.values() if p95 <= budget]
    best_within = max(fits) if fits else None
    picked = []
    for label, chosen, reference in (("no budget", tuned["chosen"], best), (f"--max-itl {args.max_itl}", chosen_within, best_within)):
        b = min(measured, key=lambda size: abs(size - chosen))  # the measured size nearest the choice
        ratio = None if reference is None else round(measured[b][0] / reference, 3)
        picked.append([label, chosen, b, round(measured[b][0], 1), reference and round(reference, 1), ratio])
        report.figure(f"choice_ratio_{'budget' if 'itl' in label else 'free'}", ratio)
    report.table("tune's choice against the best size measured independently",
                 ["budget", "tune chose B", "nearest measured B", "its tokens/s", "best tokens/s (within the budget)", "ratio"], picked,
                 f"`llamabatch tune --again` took {tuned_wall:.1f} s (process wall, model load included; its own measurement "
                 f"{tuned['seconds']:.1f} s) and measured B = {', '.join(str(p['batch_size']) for p in tuned['points'])}.")
    report.figure("tune_wall_s", round(tuned_wall, 1))
    report.figure("tuning", {k: tuned[k] for k in ("key", "settings", "prompt_tokens", "points", "seconds", "chosen")})


def estimate(args, report, model: str | None, work: Path) -> None:
    source = work / "job.txt"
    source.write_text("\n".join(prompts(args.lines)) + "\n")
    common = [*(["-m", model] if model else []), "--max-tokens", args.job_tokens, "--ignore-eos", "--temperature", 0,
              "--parallel", "auto"]
    _, out = run_command(cli("batch", source, "-o", work / "out.jsonl", "--estimate", "--json", *common))
    guess = json_lines(out)[-1]["estimate"]
    wall, out = run_command(cli("batch", source, "-o", work / "out.jsonl", "--json", *common))
    summary = json_lines(out)[-1]["summary"]
    report.table(f"A {args.lines}-line job, {args.job_tokens} tokens each (greedy, EOS ignored, --parallel auto)",
                 ["requests", "prompt tokens", "new tokens", "parallel", "estimated (s)", "the job's wall (s)", "estimate / actual"],
                 [[guess["requests"], guess["prompt_tokens"], guess["max_new_tokens"], guess["parallel"], guess["seconds"],
                   round(summary["wall_s"], 1), round(guess["seconds"] / summary["wall_s"], 3)]],
                 f"The job's own wall time (its summary), model load excluded; the process took {wall:.1f} s.")
    report.figure("estimate_ratio", round(guess["seconds"] / summary["wall_s"], 3))


def run(args, report) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # the benchmark's own measurements: tune --again makes one, and --parallel auto reads it
        os.environ["LLAMABATCH_TUNE_DIR"] = str(work / "tune")
        model = str(tiny_model(work)) if args.model == "tiny" else args.model
        for part in args.parts.split(","):
            {"choice": lambda: choice(args, report, model), "estimate": lambda: estimate(args, report, model, work)}[part]()
