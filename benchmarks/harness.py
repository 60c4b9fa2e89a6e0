"""The one harness every benchmark uses.

Sides (llamabatch and its yardstick, or two settings) are measured in alternating order, round
after round, so slow drift of a shared machine hits each alike; a figure is the median over the
rounds, shown with its spread (lowest to highest), and a comparison is the median of the ratios
paired within each round. Whatever runs in its own process (a command, a server, a native tool)
is a fresh process each time. A run's figures go to a JSON file with the machine it ran on.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .machine import machine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
T = TypeVar("T")


def alternate(sides: dict[str, Callable[[], T]], rounds: int, *, label: str = "") -> dict[str, list[T]]:
    """Each side measured once a round; the order turns every round (reversed, for two sides)."""
    names = list(sides)
    runs: dict[str, list[T]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(sides[name]())
        progress(f"{label + ': ' if label else ''}round {r + 1}/{rounds}")
    return runs


@dataclass(frozen=True)
class Spread:
    """A median and the lowest and highest value it was taken over."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def show(self, digits: int | None = None) -> str:
        if digits is None:  # three significant decimals for ratios, fewer for large figures
            digits = 0 if abs(self.median) >= 100 else 1 if abs(self.median) >= 10 else 3
        if self.low == self.high:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} ({self.low:.{digits}f}–{self.high:.{digits}f})"


def paired(numerators: Sequence[float], denominators: Sequence[float]) -> Spread:
    """The ratios of values measured in the same round: their median and spread."""
    return Spread.of([a / b for a, b in zip(numerators, denominators)])


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]
    note: str = ""

    def markdown(self) -> str:
        lines = [f"| {' | '.join(self.columns)} |", "|" + "|".join(" ---: " for _ in self.columns) + "|"]
        lines += [f"| {' | '.join(_cell(v) for v in row)} |" for row in self.rows]
        return "\n".join(lines) + (f"\n\n{self.note}" if self.note else "")


def _cell(value: Any) -> str:
    if isinstance(value, Spread):
        return value.show()
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


@dataclass
class Report:
    """What one benchmark run measured: tables (shown as they come) and named figures."""

    benchmark: str
    command: str
    smoke: bool
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    tables: list[Table] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def table(self, title: str, columns: list[str], rows: list[list[Any]], note: str = "") -> None:
        table = Table(title, columns, rows, note)
        self.tables.append(table)
        print(f"\n### {title}\n\n{table.markdown()}\n", flush=True)

    def figure(self, name: str, value: Any) -> None:
        self.figures[name] = value

    def write(self, folder: Path) -> Path:
        """The results file: the figures, the tables, the command and the machine."""
        folder.mkdir(parents=True, exist_ok=True)
        stamp = self.started[:19].replace(":", "").replace("-", "")
        path = folder / f"{self.benchmark}{'-smoke' if self.smoke else ''}-{stamp}.json"
        data = {
            "benchmark": self.benchmark, "command": self.command, "smoke": self.smoke, "started": self.started,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
            "figures": _plain(self.figures), "tables": [_plain(asdict(t)) for t in self.tables],
        }
        path.write_text(json.dumps(data, indent=1) + "\n")
        return path


def _plain(value: Any) -> Any:
    """JSON-ready: a Spread becomes {median, low, high}."""
    if isinstance(value, Spread):
        return asdict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cli(*args: Any) -> list[str]:
    """A `llamabatch` command line run with this interpreter."""
    return [sys.executable, "-m", "llamabatch.cli", *map(str, args)]


def run(command: list[str], *, env: dict | None = None, cwd: Path | None = None, timeout: float | None = None) -> tuple[float, str]:
    """Run a command to its end: its wall time and its output (stdout, then stderr). A failure
    raises with the end of its stderr."""
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, errors="replace", env={**os.environ, **(env or {})}, cwd=cwd,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-2000:]}")
    return time.perf_counter() - started, done.stdout + done.stderr


def native_output(command: list[str], wanted: str) -> tuple[float, str]:
    """A run of a llama.cpp tool whose output contains `wanted` (a regular expression): its wall
    time and its output. The tools
    print through llama.cpp's log thread, which is not flushed at exit (llama.cpp issue 22142):
    a short run loses its results now and then (half the time on the tiny model), so it runs
    again, up to NATIVE_ATTEMPTS times."""
    from llamabatch.measure.sweep import NATIVE_ATTEMPTS

    for _ in range(NATIVE_ATTEMPTS):
        wall, out = run(command)
        if re.search(wanted, out):
            return wall, out
    raise RuntimeError(f"{wanted!r} not in the output of {NATIVE_ATTEMPTS} runs of {' '.join(command)}")


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def tiny_models():
    """tests/tiny_model.py: the writers of the tests' generated GGUFs (and LoRA adapters)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    import tiny_model

    return tiny_model


def tiny_model(folder: Path) -> Path:
    """The tests' tiny generated GGUF (random weights, decodes ~100x faster than Gemma 3 270M):
    what shows llamabatch's own per-step cost."""
    return tiny_models().write_tiny_model(folder / "tiny.gguf")


def model_path(name: str | None) -> Path:
    """A catalog name or a GGUF path, as a GGUF path (native tools take paths)."""
    from llamabatch.catalog import Catalog

    if name and name.endswith(".gguf"):
        return Path(name)
    return Catalog.load().resolve(name).gguf_path()
