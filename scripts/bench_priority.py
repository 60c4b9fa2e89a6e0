#!/usr/bin/env python
"""Interactive requests beside a server-side batch: time to first token, and what the batch keeps.

One `llamabatch serve` (priority scheduling) measures, in one run:
  idle        the interactive load alone: a streamed request every --interval seconds
  batch       a Batch API batch of --batch-requests alone (its tokens/s from /metrics)
  batch+int   the same batch with the interactive load beside it
The batch phases alternate (alone, beside, alone, beside) so drift on a shared host hits both.
A second server with --scheduling-policy fcfs runs batch+int again: the same load without
priorities. Figures: TTFT p50/p95 per phase and their ratio to idle, the batch's tokens/s beside
the interactive load over alone, and the mean engine step in each phase (what an interactive
request waits for at least: the step in flight when it arrives).

    python scripts/bench_priority.py --model gemma3-270m --parallel 8 --threads 2
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai

SUBJECTS = ["the sea", "bread", "trains", "owls", "glass", "chess", "rain", "copper", "maps", "tea", "kites", "bees"]


def start_server(args, data_dir: Path, policy: str) -> tuple[subprocess.Popen, str]:
    port = 8300 + (policy == "fcfs")
    command = [sys.executable, "-m", "llamabatch.cli", "serve", "-m", args.model, "--parallel", str(args.parallel),
               "--threads", str(args.threads), "--data-dir", str(data_dir), "--port", str(port), "--scheduling-policy", policy]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return process, base
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise SystemExit(f"the {policy} server did not start")


def metrics(base: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by name with its labels."""
    samples = (line.rsplit(" ", 1) for line in httpx.get(f"{base}/metrics").text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in samples}


def ttft(base: str, args, prompt: str) -> float | None:
    body = {"model": "m", "prompt": prompt, "max_tokens": args.interactive_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    started = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as reply:
        if reply.status_code != 200:
            return None
        lines = reply.iter_lines()
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - started
                for _ in lines:  # read to the end, as a client would
                    pass
                return first
    return None


def interactive(base: str, args, seconds: float, tag: str) -> list[float]:
    """A streamed request every --interval seconds for `seconds`, each on its own thread."""
    results: list[float | None] = []
    threads = []
    n = max(1, int(seconds / args.interval))
    t0 = time.perf_counter()
    for k in range(n):
        time.sleep(max(0.0, t0 + k * args.interval - time.perf_counter()))
        prompt = f"Question {tag}-{k}: in two sentences, what is special about {SUBJECTS[k % len(SUBJECTS)]}?"
        thread = threading.Thread(target=lambda p=prompt: results.append(ttft(base, args, p)))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    failed = sum(r is None for r in results)
    if failed:
        print(f"  {failed} interactive requests failed", file=sys.stderr)
    return [r for r in results if r is not None]


def start_batch(base: str, args) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    lines = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "m", "prompt": f"Note {i}: a few words about {SUBJECTS[i % len(SUBJECTS)]}.",
                                  "max_tokens": args.batch_tokens, "temperature": 0, "ignore_eos": True}})
             for i in range(args.batch_requests)]
    source = client.files.create(file=("batch.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions", completion_window="24h")
    while client.batches.retrieve(batch.id).status != "in_progress":
        time.sleep(0.1)
    time.sleep(args.warmup)  # every slot busy with batch work
    return batch.id


def cancel_batch(base: str, batch_id: str) -> dict:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    client.batches.cancel(batch_id)
    while (batch := client.batches.retrieve(batch_id)).status == "cancelling":
        time.sleep(0.1)
    return batch.request_counts.model_dump()


class Window:
    """Counters over one phase: the batch's tokens/s and the mean engine step."""

    def __init__(self, base: str) -> None:
        self.base, self.before, self.t0 = base, metrics(base), time.perf_counter()

    def close(self) -> dict:
        after, seconds = metrics(self.base), time.perf_counter() - self.t0
        delta = lambda name: after.get(name, 0.0) - self.before.get(name, 0.0)  # noqa: E731
        steps = delta("llamabatch_step_seconds_count")
        return {"batch_tokens_per_s": delta('llamabatch_generated_tokens_total{class="batch"}') / seconds,
                "mean_step_ms": 1000 * delta("llamabatch_step_seconds_sum") / steps if steps else 0.0,
                "preemptions": delta("llamabatch_priority_preemptions")}


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50_s": float(np.percentile(values, 50)), "p95_s": float(np.percentile(values, 95))} if values else {"n": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-requests", type=int, default=2000)
    parser.add_argument("--batch-tokens", type=int, default=32)
    parser.add_argument("--interactive-tokens", type=int, default=16)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between interactive requests (light load)")
    parser.add_argument("--phase", type=float, default=30.0, help="seconds per measured phase")
    parser.add_argument("--warmup", type=float, default=3.0)
    args = parser.parse_args()
    report: dict = {"settings": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        server, base = start_server(args, Path(tmp) / "priority", "priority")
        try:
            interactive(base, args, 2 * args.interval, "warm")  # the first requests pay for warming up
            window = Window(base)
            idle = interactive(base, args, args.phase, "idle")
            report["idle"] = {**summary(idle), **window.close()}
            batch_id = start_batch(base, args)
            alone, beside, windows = [], [], {"alone": [], "beside": []}
            for round_ in range(2):
                window = Window(base)
                time.sleep(args.phase)
                windows["alone"].append(window.close())
                window = Window(base)
                beside += interactive(base, args, args.phase, f"p{round_}")
                windows["beside"].append(window.close())
            report["batch_alone"] = _mean(windows["alone"])
            report["batch_priority"] = {**summary(beside), **_mean(windows["beside"])}
            report["batch_counts_at_cancel"] = cancel_batch(base, batch_id)
        finally:
            server.terminate()
            server.wait()
        server, base = start_server(args, Path(tmp) / "fcfs", "fcfs")
        try:
            interactive(base, args, 2 * args.interval, "warm")
            batch_id = start_batch(base, args)
            window = Window(base)
            fifo = interactive(base, args, args.phase, "fifo")
            report["batch_fcfs"] = {**summary(fifo), **window.close()}
            cancel_batch(base, batch_id)
        finally:
            server.terminate()
            server.wait()
    idle_p50, idle_p95 = report["idle"]["p50_s"], report["idle"]["p95_s"]
    for phase in ("batch_priority", "batch_fcfs"):
        if report[phase]["n"]:
            report[phase]["p50_vs_idle"] = report[phase]["p50_s"] / idle_p50
            report[phase]["p95_vs_idle"] = report[phase]["p95_s"] / idle_p95
    report["batch_throughput_beside_vs_alone"] = report["batch_priority"]["batch_tokens_per_s"] / report["batch_alone"]["batch_tokens_per_s"]
    print(json.dumps(report, indent=1))


def _mean(windows: list[dict]) -> dict:
    return {key: float(np.mean([w[key] for w in windows])) for key in windows[0]} | {
        "rounds": [round(w["batch_tokens_per_s"], 1) for w in windows]}


if __name__ == "__main__":
    main()
