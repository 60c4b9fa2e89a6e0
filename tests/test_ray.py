"""Batch jobs on a local Ray instance: every row once, the same lines as one process, an actor
killed mid-job, resume. Skipped where Ray is not installed (pip install -e ".[ray]")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from llamabatch import SamplingParams  # noqa: E402
from llamabatch.jobs import ray_stage  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
WORDS = ["river", "castle", "engine", "garden", "winter", "signal", "forest", "market", "violin", "planet"]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def prompts_file(path: Path, n: int, min_tokens: int = 4) -> Path:
    # Distinct prompts of different lengths, a few of them JSON lines with their own ids and settings.
    lines = []
    for i in range(n):
        words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 7))
        lines.append(json.dumps({"id": f"req-{i}", "prompt": f"{words} {i}", "max_tokens": min_tokens + i % 5}))
    lines.insert(17, "not json")  # a bad line goes to the error file, and the job goes on
    path.write_text("\n".join(lines) + "\n")
    return path


def engine_options(tiny_model: Path, **extra) -> dict:
    return {"model": str(tiny_model), "n_parallel": 8, "n_ctx": 2048, **extra}


def ids(path: Path, key: str = "id") -> Counter:
    return Counter(json.loads(line)[key] for line in path.read_text().splitlines())


def choices(path: Path) -> dict[str, list]:
    return {r["id"]: [(c["text"], c["finish_reason"]) for c in r["choices"]] for r in map(json.loads, path.open())}


def one_process_job(tiny_model: Path, source: Path, output: Path) -> dict:
    """`llamabatch batch` in a process of its own, deterministic; its summary."""
    done = subprocess.run(
        [sys.executable, "-m", "llamabatch.cli", "batch", str(source), "-o", str(output), "-m", str(tiny_model),
         "--parallel", "8", "--ctx", "2048", "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "--deterministic", "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode in (0, 1), done.stderr  # 1: a bad line failed
    return json.loads(done.stdout.splitlines()[-1])["summary"]


def test_every_row_once_and_the_same_lines_as_one_process(tiny_model, tmp_path):
    """Both sides in deterministic mode: the actors' batches are not the single process's, and
    greedy text is only guaranteed equal across batch compositions there. (The single-process run
    is a CLI process of its own: the mode must set ggml's kernels before anything decodes.)"""
    source = prompts_file(tmp_path / "in.jsonl", 500)
    single = one_process_job(tiny_model, source, tmp_path / "single.jsonl")
    job = ray_stage.RayBatchJob(engine_options(tiny_model, deterministic=True), source, tmp_path / "ray.jsonl",
                                replicas=2, threads=1, base=GREEDY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = job.run()
    # Nothing of ours Ray calls deprecated (max_concurrency in ray_remote_args goes in Ray 2.64)
    assert [str(w.message) for w in caught if w.filename.endswith("ray_stage.py")] == []
    assert (summary.done, summary.failed, summary.total) == (single["done"], single["failed"], 501) == (500, 1, 501)
    written = ids(tmp_path / "ray.jsonl")
    assert set(written) == {f"req-{i}" for i in range(500)} and max(written.values()) == 1
    assert choices(tmp_path / "ray.jsonl") == choices(tmp_path / "single.jsonl")
    error = json.loads((tmp_path / "ray.jsonl.errors.jsonl").read_text())
    assert error["id"] == "line-18" and "not valid JSON" in error["error"]["message"]
    assert summary.completion_tokens == single["completion_tokens"]


def test_resume_on_ray_skips_what_the_output_holds(tiny_model, tmp_path):
    source = prompts_file(tmp_path / "in.jsonl", 200)
    out = tmp_path / "out.jsonl"
    one_process_job(tiny_model, source, out)
    full = choices(out)
    kept = out.read_text().splitlines()[:120]
    out.write_text("\n".join(kept) + "\n" + kept[120 - 1][:25])  # and a torn line, as a kill leaves
    summary = ray_stage.RayBatchJob(engine_options(tiny_model, deterministic=True), source, out, replicas=1, threads=2,
                                    base=GREEDY).run()
    assert summary.skipped == 120 + 1  # the bad line's error was recorded too
    assert summary.done == 80 and summary.failed == 0
    assert max(ids(out).values()) == 1 and choices(out) == full


def predictor_processes(besides: set[int] = frozenset()) -> list[psutil.Process]:
    """The BatchPredictor actors' processes now alive, but those whose pids are in `besides`."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if p.pid not in besides and any("BatchPredictor" in part for part in p.info["cmdline"] or []):
            found.append(p)
    return found


def test_an_actor_killed_mid_job_loses_no_row_and_writes_none_twice(tiny_model, tmp_path):
    source = prompts_file(tmp_path / "in.jsonl", 800, min_tokens=120)  # long enough to kill an actor mid-job
    out = tmp_path / "out.jsonl"
    job = ray_stage.RayBatchJob(engine_options(tiny_model), source, out, replicas=2, threads=1, base=GREEDY)
    # The previous tests' actors may still be shutting down: only this job's are candidates.
    earlier = {p.pid for p in predictor_processes()}
    result = {}
    runner = threading.Thread(target=lambda: result.setdefault("summary", job.run()))
    runner.start()
    deadline = time.monotonic() + 120
    while not predictor_processes(earlier) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2.0)  # the actors have loaded the model and are generating (the job takes ~10 s)
    victims = predictor_processes(earlier)
    assert victims, "no BatchPredictor actor process found"
    os.kill(victims[0].pid, signal.SIGKILL)
    mid_job = runner.is_alive()
    killed_after = len(out.read_text().splitlines()) if out.exists() else 0
    runner.join(timeout=300)
    summary = result["summary"]
    written = ids(out)
    assert mid_job and killed_after < 800, "the job ended before the kill: nothing was tested"
    assert set(written) == {f"req-{i}" for i in range(800)} and max(written.values()) == 1
    assert summary.done == 800 and summary.failed == 1
    print(f"killed actor pid {victims[0].pid} after {killed_after} lines; the job wrote {len(written)} ids once each")


def test_a_line_s_relative_image_path_starts_at_the_job_file_s_folder(tiny_model, tmp_path):
    """An actor runs in Ray's working folder, not the job file's: a line's "image" path relative
    to the job file is read from there all the same, as `llamabatch batch` reads it."""
    from test_images import RED
    from tiny_model import write_tiny_projector

    projector = write_tiny_projector(tmp_path / "mmproj.gguf")
    (tmp_path / "job" / "photos").mkdir(parents=True)
    (tmp_path / "job" / "photos" / "red.png").write_bytes(RED)
    source = tmp_path / "job" / "in.jsonl"
    source.write_text(json.dumps({"id": "red", "prompt": "what is it", "image": "photos/red.png", "max_tokens": 4}) + "\n")
    job = ray_stage.RayBatchJob(engine_options(tiny_model, mmproj=str(projector), n_parallel=2), source, tmp_path / "ray.jsonl",
                                replicas=1, threads=1, base=GREEDY)
    summary = job.run()
    errors = tmp_path / "ray.jsonl.errors.jsonl"
    assert (summary.done, summary.failed) == (1, 0), errors.read_text() if errors.exists() else ""
    assert ids(tmp_path / "ray.jsonl") == Counter({"red": 1})
