"""Ray's cost on one machine: `llamabatch batch` on the same prompts, single process against a
local Ray instance with 1 actor (all cores) and 2 actors (the cores split between them).

Each setting runs the real command (`llamabatch batch ... --json`) in a fresh process, rotating
the order each round; the figures are medians over --rounds. "command" is the whole command's
wall time (Ray's start, actor start and model load included), "job" the summary's wall time.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .harness import Spread, alternate, cli, json_lines, paired, run as run_command, tiny_model

SMOKE = ["--model", "tiny", "--prompts", "8", "--max-tokens", "4", "--rounds", "1"]
SUBJECTS = ["rivers", "castles", "engines", "gardens", "winter", "radio", "forests", "markets", "violins", "planets",
            "bridges", "volcanoes", "libraries", "bees", "glaciers", "trains"]
SETTINGS = {
    "single process": [],
    "ray, 1 actor x 2 threads": ["--ray", "local", "--replicas", "1", "--threads", "2"],
    "ray, 2 actors x 1 thread": ["--ray", "local", "--replicas", "2", "--threads", "1"],
}


def arguments(parser) -> None:
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")


def job(args, source: Path, extra: list[str], out: Path) -> dict:
    command = cli("batch", source, "-o", out, "--overwrite", "--max-tokens", args.max_tokens, "--temperature", 0, "--ignore-eos",
                  "--json", *extra, *(["-m", args.model] if args.model else []))
    wall, output = run_command(command)
    summary = json_lines(output)[-1]["summary"]
    if summary["done"] != args.prompts:
        raise RuntimeError(f"{summary['done']} of {args.prompts} requests done: {summary}")
    return {"command_s": wall, "job_s": summary["wall_s"], "tokens": summary["completion_tokens"]}


def run(args, report) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.model == "tiny":
            args.model = str(tiny_model(work))
        source = work / "prompts.txt"
        source.write_text("".join(f"Write a short note about {SUBJECTS[i % len(SUBJECTS)]}, number {i}.\n" for i in range(args.prompts)))
        runs = alternate({name: (lambda extra=extra: job(args, source, extra, work / "out.jsonl")) for name, extra in SETTINGS.items()},
                         args.rounds, label="settings")
    single = [r["command_s"] for r in runs["single process"]]
    rows = []
    for name, results in runs.items():
        command = [r["command_s"] for r in results]
        rows.append([name, Spread.of(command), Spread.of([r["job_s"] for r in results]), results[0]["tokens"] / Spread.of(command).median,
                     paired(single, command)])
        report.figure(f"speed_vs_single: {name}", rows[-1][-1])
    report.table(f"{args.prompts} prompts x {args.max_tokens} tokens through `llamabatch batch`",
                 ["setting", "command (s)", "job (s)", "tokens/s (command)", "speed vs single process"], rows,
                 f"Medians (lowest–highest) of {args.rounds} rotating rounds; the command's time includes Ray's start and model loads.")
