"""`python -m benchmarks report`: the docs' result pages, made from the results files.

For each benchmark, docs/results/NAME.md shows every results file of it measured without a GPU
(newest first), each with the machine it ran on and the command that reproduces it, so a figure
that varies between machines is shown from each; docs/results/gpu.md shows those measured on a
GPU, benchmark by benchmark. The sweep's points are also drawn (docs/results/sweep.png), and tune's curve (docs/results/tune.png).
The docs build runs this too (scripts/mkdocs_hooks.py), so the pages never drift from the files.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from .harness import RESULTS, ROOT, Spread, Table

DOCS = ROOT / "docs" / "results"


def load(folder: Path = RESULTS) -> dict[str, list[dict]]:
    """Full (not smoke) results by benchmark, newest first."""
    found: dict[str, list[dict]] = {}
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if not data.get("smoke"):
            found.setdefault(data["benchmark"], []).append({**data, "file": path.name})
    return {name: sorted(runs, key=lambda d: d["started"], reverse=True) for name, runs in sorted(found.items())}


def machine_line(m: dict) -> str:
    gpu = m.get("gpu") or "no GPU"
    native = f"; native tools: llama.cpp {m['native_build']}" if m.get("native_build") else ""
    dirty = " (uncommitted changes)" if m.get("llamabatch_dirty") else ""
    note = f" ({m['note']})" if m.get("note") else ""
    return (f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {gpu}; llama-cpp-python {m['llama_cpp_python']}"
            f"{native}; llamabatch {m['llamabatch_commit']}{dirty}{note}")


def page(name: str, runs: list[dict]) -> str:
    """The newest run under a heading; earlier ones below it, named in bold (not headings: a page's
    contents would list the same command many times)."""
    lines = [f"<!-- made by `python -m benchmarks report` from benchmarks/results/{name}-*.json: edit those, not this -->", ""]
    for k, data in enumerate(runs):
        title = f"{data['started'][:10]} {data['started'][11:16]} UTC: `{shown_command(data['command'])}`"
        lines += [f"#### {title}" if k == 0 else f"**Earlier, {title}**", "",
                  f"*Machine:* {machine_line(data['machine'])}. *File:* `benchmarks/results/{data['file']}`.", ""]
        for table in data["tables"]:
            cells = [[_value(v) for v in row] for row in table["rows"]]
            lines += [f"**{table['title']}**", "", Table(table["title"], table["columns"], cells, table["note"]).markdown(), ""]
    return "\n".join(lines)


def shown_command(command: str) -> str:
    """The command as a reader would type it: the earlier checkout --before compares with, and the
    models of real shapes the GPU run writes, were files of the machine it ran on."""
    command = re.sub(r"--before \S+", "--before <a checkout of the earlier commit>", command)
    return re.sub(r"\S*/shapes/([\w.-]+)\.gguf", r"<\1's shape: benchmarks/shapes.py>", command)  # written by the GPU run


def _value(v):
    """A Spread stored as {median, low, high} shows as one again."""
    if isinstance(v, dict) and set(v) == {"median", "low", "high"}:
        return Spread(**v)
    return v


def sweep_plot(data: dict, path: Path) -> None:
    from llamabatch.measure.plot import sweep_plot as draw
    from llamabatch.measure.sweep import SweepPoint

    points = [SweepPoint(**{k: v for k, v in p.items() if k in SweepPoint.__dataclass_fields__}) for p in data["figures"]["points"]]
    draw(points, path, title=f"{data['command']} ({data['machine']['cpu']}, {data['machine']['cores']} cores)")


def tune_plot(data: dict, path: Path) -> None:
    from llamabatch.engine.sizing.tuning import Tuning
    from llamabatch.measure.plot import tune_plot as draw

    measured = Tuning.from_dict(data["figures"]["tuning"])
    draw(measured, next(p for p in measured.points if p.batch_size == data["figures"]["tuning"]["chosen"]), path)


README = ROOT / "README.md"
START, END = "<!-- results: made by python -m benchmarks report -->", "<!-- /results -->"


def front_table(results: dict[str, list[dict]]) -> str:
    """The README's short table: the newest default runs of sweep (Gemma), overhead (tiny) and
    sampling (Gemma, B = 32)."""
    rows = []
    sweep = next((d for d in results.get("sweep", []) if "--model" not in d["command"]), None)
    if sweep:
        by_b = {p["batch_size"]: p for p in sweep["figures"]["points"]}
        rows.append(["Gemma 3 270M: llamabatch S_TG (tokens/s)", *(f"{by_b[b]['s_tg']:.0f}" if b in by_b else "" for b in (1, 8, 32)),
                     "`python -m benchmarks sweep`"])
        rows.append(["Gemma 3 270M: S_TG / native llama-batched-bench", *(f"{by_b[b]['s_tg_ratio']:.2f}" if b in by_b else "" for b in (1, 8, 32)),
                     "`python -m benchmarks sweep`"])
    overhead = next((d for d in results.get("overhead", []) if _settings(d["command"]) == "python -m benchmarks overhead"), None)
    if overhead:
        f = overhead["figures"]
        rows.append(["tiny model (llamabatch's own cost): S_TG / native",
                     *(f"{f[f'ratio_b{b}']['median']:.2f}" if f"ratio_b{b}" in f else "" for b in (1, 8, 32)), "`python -m benchmarks overhead`"])
    sampling = next((d for d in results.get("sampling", []) if _settings(d["command"]) == "python -m benchmarks sampling"), None)
    if sampling:
        over = sampling["figures"]["over_greedy"]
        rows += [[f"Gemma 3 270M: sampled {name} / greedy", "", "", f"{over[key]['median']:.2f}", "`python -m benchmarks sampling`"]
                 for name, key in (("as OpenAI clients ask (top-p, no top-k)", "top-p 0.95, no top-k (OpenAI)"),
                                   ("with top-k 40", "top-k 40, top-p 0.95")) if key in over]
    lines = ["| measured | B = 1 | B = 8 | B = 32 | command |", "| --- | ---: | ---: | ---: | --- |"]
    return "\n".join(lines + [f"| {' | '.join(row)} |" for row in rows])


def _settings(command: str) -> str:
    """A benchmark's command without its --rounds: more rounds measure the same thing."""
    return re.sub(r"\s+--rounds[ =]\d+", "", command).strip()


def write_readme(results: dict[str, list[dict]], path: Path = README) -> None:
    text = path.read_text()
    if START not in text:
        return
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{START}\n{front_table(results)}\n{END}{tail}")


def write(docs: Path = DOCS, folder: Path = RESULTS, readme: bool = True) -> list[Path]:
    """docs/results' pages (and plots) from the results files; with `readme`, the README's table."""
    docs.mkdir(parents=True, exist_ok=True)
    written = []
    results = load(folder)
    if readme and folder == RESULTS:
        write_readme(results)
    on_gpu = {name: [d for d in runs if d["machine"].get("gpu")] for name, runs in results.items()}
    for name, runs in results.items():
        runs = [d for d in runs if not d["machine"].get("gpu")]
        if not runs:
            continue
        path = docs / f"{name}.md"
        path.write_text(page(name, runs) + "\n")
        written.append(path)
        if name == "sweep":
            sweep_plot(runs[0], docs / "sweep.png")
            written.append(docs / "sweep.png")
        if name == "tune":
            tune_plot(runs[0], docs / "tune.png")
            written.append(docs / "tune.png")
    (docs / "gpu.md").write_text("\n".join(f"### `{name}`\n\n{page(name, runs)}" for name, runs in on_gpu.items() if runs) + "\n")
    written.append(docs / "gpu.md")
    return written


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks report", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--docs", type=Path, default=DOCS)
    args = parser.parse_args(argv)
    for path in write(args.docs, args.results):
        print(path)
    return 0
