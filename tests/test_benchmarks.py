"""The benchmarks package's harness and report (each benchmark itself runs in CI with --smoke)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import __main__ as registry
from benchmarks.harness import RESULTS, Report, Spread, alternate, paired
from benchmarks.report import front_table, load, page

ROOT = Path(__file__).resolve().parent.parent


def test_alternate_turns_the_order_every_round_and_keeps_each_sides_values():
    calls = []
    sides = {name: (lambda name=name: calls.append(name) or len(calls)) for name in ("a", "b", "c")}
    runs = alternate(sides, 3)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert runs == {"a": [1, 6, 8], "b": [2, 4, 9], "c": [3, 5, 7]}


def test_paired_ratios_are_taken_within_a_round():
    spread = paired([2.0, 6.0, 3.0], [1.0, 2.0, 3.0])  # ratios 2, 3, 1
    assert (spread.median, spread.low, spread.high) == (2.0, 1.0, 3.0)
    assert Spread.of([5.0]).show() == "5.000"
    assert Spread.of([1.0, 2.0, 3.0]).show() == "2.000 (1.000–3.000)"


def test_a_results_file_holds_the_machine_and_turns_into_a_page(tmp_path):
    report = Report("overhead", "python -m benchmarks overhead", smoke=False)
    report.figure("ratio_b1", Spread.of([0.5, 0.7]))
    report.table("S_TG", ["B", "ratio"], [[1, Spread.of([0.5, 0.7])]], "a note")
    path = report.write(tmp_path)
    data = json.loads(path.read_text())
    assert {"cpu", "cores", "gpu", "llama_cpp_python", "llama_cpp_system", "native_build", "llamabatch_commit"} <= set(data["machine"])
    assert data["figures"]["ratio_b1"] == {"median": 0.6, "low": 0.5, "high": 0.7}
    [run] = load(tmp_path)["overhead"]
    text = page("overhead", [run])
    assert "`python -m benchmarks overhead`" in text and data["machine"]["cpu"] in text
    assert "| 1 | 0.600 (0.500–0.700) |" in text and "a note" in text
    assert "| tiny model (llamabatch's own cost): S_TG / native | 0.60 |" in front_table(load(tmp_path))  # the README's row
    more = Report("overhead", "python -m benchmarks overhead --rounds 7", smoke=False)  # more rounds, the same measure
    more.figure("ratio_b1", Spread.of([0.9]))
    more.write(tmp_path / "more")
    assert "| tiny model (llamabatch's own cost): S_TG / native | 0.90 |" in front_table(load(tmp_path / "more"))
    other = Report("overhead", "python -m benchmarks overhead --batch-sizes 1", smoke=False)  # another measure: not the README's
    other.figure("ratio_b1", Spread.of([0.1]))
    other.write(tmp_path / "other")
    assert "tiny model" not in front_table(load(tmp_path / "other"))


def test_a_page_heads_its_newest_run_and_names_no_local_folder(tmp_path):
    """A page's contents list each benchmark once: earlier runs are named in bold, not headed; a
    --before checkout's folder (a path of the machine that ran it) is not shown as typed."""
    for k in range(3):
        report = Report("store", "python -m benchmarks store --before /tmp/before --rounds 3", smoke=False)
        report.table("gaps", ["side"], [[str(k)]], "")
        report.write(tmp_path / str(k))
        for path in (tmp_path / str(k)).glob("*.json"):
            data = json.loads(path.read_text())
            path.write_text(json.dumps({**data, "started": f"2026-11-2{k}T10:00:00+0000"}))
            path.rename(tmp_path / path.name.replace(".json", f"-{k}.json"))
    text = page("store", load(tmp_path)["store"])
    assert [line for line in text.splitlines() if line.startswith("#")] == [
        "#### 2026-11-22 10:00 UTC: `python -m benchmarks store --before <a checkout of the earlier commit> --rounds 3`"]
    assert text.count("**Earlier, 2026-11-2") == 2 and "/tmp/before" not in text


def test_the_committed_results_make_the_readme_table():
    results = load(RESULTS)
    assert results, "benchmarks/results holds the published runs"
    table = front_table(results)
    readme = (ROOT / "README.md").read_text()
    assert table in readme, "the README's results table is stale: python -m benchmarks report"


def test_no_results_file_records_where_it_was_written():
    """--out is this machine's folder: neither a new run's command nor a committed file names it."""
    assert registry._without_out(["overhead", "--out", "/root/out", "--rounds", "3", "--out=/x"]) == ["overhead", "--rounds", "3"]
    for runs in load(RESULTS).values():
        assert not any("--out" in run["command"] for run in runs)


@pytest.mark.parametrize("name", registry.BENCHMARKS)
def test_every_benchmark_is_listed_with_a_smoke_run(name):
    bench = registry.module(name)
    assert bench.__doc__.strip().splitlines()[0]
    assert isinstance(bench.SMOKE, list) and callable(bench.arguments) and callable(bench.run)


def test_list_names_every_benchmark():
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0
    assert [line.split()[0] for line in done.stdout.splitlines()] == registry.BENCHMARKS
