"""What a batch job costs: peak memory against the number of prompts, and `batch` against `run`.

memory      `llamabatch batch` on the tests' tiny model over N short prompts (--max-tokens 1),
            for each N; the peak RSS of each process (os.wait4). Memory must not grow with N.
throughput  the same prompts (greedy, --max-tokens 32) through `llamabatch run --prompts-file`
            and `llamabatch batch`, alternating processes, on the default model: generated
            tokens/s by process wall time (model load included) and by each command's own figure.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

from .harness import Spread, alternate, cli, paired, tiny_model

SMOKE = ["--sizes", "200", "--prompts", "8", "--max-tokens", "4", "--parallel", "4", "--rounds", "1", "--model", "tiny"]
WORDS = "the a of is and to in capital France Paris def fib once upon time hello world".split()
SUBJECTS = ["the moon", "bread", "rivers", "chess", "volcanoes", "the violin", "honey bees", "glass", "maps", "tea",
            "bicycles", "snow", "lighthouses", "paper", "owls", "copper", "gardens", "trains", "clocks", "salt"]
FORMS = ["Tell me about {}.", "Write a short poem about {}.", "Explain {} to a child.", "Three facts about {}:",
         "A story that begins with {}", "Why do people love {}?"]


def arguments(parser) -> None:
    parser.add_argument("--parts", default="memory,throughput")
    parser.add_argument("--sizes", default="10000,100000", help="memory: prompts per job")
    parser.add_argument("--model", default=None, help="throughput: catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--parallel", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)


def measured(command: list[str]) -> tuple[float, int, str]:
    """Run a command; its wall seconds, peak RSS (KiB) and stdout."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"failed: {' '.join(command)}")
        out.seek(0)
        return wall, usage.ru_maxrss, out.read()


def memory(args, report, work: Path) -> None:
    model = tiny_model(work)
    rng = random.Random(0)
    rows = []
    for n in map(int, args.sizes.split(",")):
        source = work / f"prompts-{n}.txt"
        source.write_text("".join(" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) + "\n" for _ in range(n)))
        wall, rss, _ = measured(cli("batch", source, "-o", work / f"out-{n}.jsonl", "-m", model, "--max-tokens", 1,
                                    "--parallel", 32, "--ctx", 8192, "--json"))
        rows.append([n, round(rss / 1024, 1), round(wall, 1), round(n / wall)])
        report.figure(f"peak_rss_mib_{n}", rows[-1][1])
    report.table("`llamabatch batch` on the tiny model, --max-tokens 1", ["prompts", "peak RSS (MiB)", "wall (s)", "requests/s"], rows)


def throughput(args, report, work: Path) -> None:
    model = str(tiny_model(work)) if args.model == "tiny" else args.model
    prompts = [FORMS[i % len(FORMS)].format(SUBJECTS[i // len(FORMS) % len(SUBJECTS)]) + f" ({i})" for i in range(args.prompts)]
    source = work / "prompts.txt"
    source.write_text("\n".join(prompts) + "\n")
    common = ["--max-tokens", args.max_tokens, "--temperature", 0, "--parallel", args.parallel, *(["-m", model] if model else [])]
    outputs = iter(range(10**6))

    def side(command):
        def measure() -> tuple[float, float]:
            wall, _, stdout = measured(command())
            summary = json.loads(stdout.splitlines()[-1])["summary"]
            return summary["completion_tokens"] / wall, summary["tokens_per_s"]
        return measure

    runs = alternate({
        "run": side(lambda: cli("run", "--prompts-file", source, "--json", *common)),
        "batch": side(lambda: cli("batch", source, "-o", work / f"out-{next(outputs)}.jsonl", "--json", *common)),
    }, args.rounds, label="run/batch")
    rows = []
    for k, label in enumerate(("process wall (load included)", "the command's own figure")):
        run_, batch_ = [r[k] for r in runs["run"]], [r[k] for r in runs["batch"]]
        rows.append([label, Spread.of(run_), Spread.of(batch_), paired(batch_, run_)])
    report.figure("batch_vs_run", rows[1][-1])
    report.table(f"{args.prompts} prompts, --max-tokens {args.max_tokens}, --parallel {args.parallel} (tokens/s)",
                 ["measured by", "run", "batch", "batch / run"], rows, f"{args.rounds} alternating rounds.")


def run(args, report) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.parts.split(","):
            {"memory": memory, "throughput": throughput}[part](args, report, Path(tmp))
