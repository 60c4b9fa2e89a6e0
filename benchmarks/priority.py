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
"""

from __future__ import annotations

import io
import json
import re
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai

from .harness import progress, tiny_model
from .servers import Server, llamabatch_serve

# The batch must outlast the phases (about 5 s; it is cancelled after them): 400 x 1,024 tokens,
# where the tiny model decodes 15,000 tokens/s on 2 slots on a fast machine (400 x 8 ended early).
SMOKE = ["--model", "tiny", "--parallel", "2", "--batch-requests", "400", "--batch-tokens", "1024", "--interactive-tokens", "4",
         "--interval", "0.2", "--phase", "1", "--warmup", "0.2"]

SUBJECTS = ["the sea", "bread", "trains", "owls", "glass", "chess", "rain", "copper", "maps", "tea", "kites", "bees"]


def start_server(args, data_dir: Path, policy: str) -> Server:
    return llamabatch_serve(args.model, "--parallel", args.parallel, "--threads", args.threads, "--data-dir", data_dir,
                            "--scheduling-policy", policy)


def metrics(base: str) -> dict[str, float]:
    """Every sample of /metrics (the one model's), keyed by name with its labels but the model."""
    samples = (line.rsplit(" ", 1) for line in httpx.get(f"{base}/metrics").text.splitlines() if line and not line.startswith("#"))
    unlabelled = lambda name: re.sub(r'\{,|,\}|,,', lambda m: {"{,": "{", ",}": "}", ",,": ","}[m[0]],  # noqa: E731
                                     re.sub(r'model="[^"]*"', "", name)).replace("{}", "")
    return {unlabelled(name): float(value) for name, value in samples}


def ttft(base: str, args, prompt: str) -> float | None:
    body = {"model": args.served, "prompt": prompt, "max_tokens": args.interactive_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    started = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as reply:
        if reply.status_code != 200:
            progress(f"an interactive request got {reply.status_code}: {reply.read()[:200]!r}")
            return None
        lines = reply.iter_lines()
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:  # the first token's chunk
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
    if failed:  # no TTFT figures from a phase whose requests failed (each failure is shown above)
        raise RuntimeError(f"{failed} of {len(results)} interactive requests failed")
    return results


def start_batch(base: str, args) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    lines = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": args.served, "prompt": f"Note {i}: a few words about {SUBJECTS[i % len(SUBJECTS)]}.",
                                  "max_tokens": args.batch_tokens, "temperature": 0, "ignore_eos": True}})
             for i in range(args.batch_requests)]
    source = client.files.create(file=("batch.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions", completion_window="24h")
    while client.batches.retrieve(batch.id).status == "validating":
        time.sleep(0.1)
    time.sleep(args.warmup)  # every slot busy with batch work
    return batch.id


def cancel_batch(base: str, batch_id: str) -> dict:
    """Cancel the batch the phases ran beside; it must still be running, or some phase ran with
    no batch beside it and its figures mean nothing."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    status = client.batches.retrieve(batch_id).status
    if status not in ("validating", "in_progress"):
        raise RuntimeError(f"the batch ended ({status}) before the measured phases did: give it more --batch-requests "
                           "or --batch-tokens")
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
                "preemptions": delta("llamabatch_priority_preemptions_total")}


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50_s": float(np.percentile(values, 50)), "p95_s": float(np.percentile(values, 95))} if values else {"n": 0}


def arguments(parser) -> None:
    parser.add_argument("--model", default="gemma3-270m", help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-requests", type=int, default=2000)
    parser.add_argument("--batch-tokens", type=int, default=32)
    parser.add_argument("--interactive-tokens", type=int, default=16)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between interactive requests (light load)")
    parser.add_argument("--phase", type=float, default=30.0, help="seconds per measured phase")
    parser.add_argument("--warmup", type=float, default=3.0)


def run(args, report) -> None:
    phases: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            args.model = str(tiny_model(Path(tmp)))
        with start_server(args, Path(tmp) / "priority", "priority") as server:
            base = server.base
            args.served = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]  # requests must name the served model
            interactive(base, args, 2 * args.interval, "warm")  # the first requests pay for warming up
            window = Window(base)
            idle = interactive(base, args, args.phase, "idle")
            phases["idle"] = {**summary(idle), **window.close()}
            batch_id = start_batch(base, args)
            beside, windows = [], {"alone": [], "beside": []}
            for round_ in range(2):  # alone, beside, alone, beside: drift hits both
                window = Window(base)
                time.sleep(args.phase)
                windows["alone"].append(window.close())
                window = Window(base)
                beside += interactive(base, args, args.phase, f"p{round_}")
                windows["beside"].append(window.close())
            phases["batch alone"] = _mean(windows["alone"])
            phases["batch + interactive (priority)"] = {**summary(beside), **_mean(windows["beside"])}
            report.figure("batch_counts_at_cancel", cancel_batch(base, batch_id))
        with start_server(args, Path(tmp) / "fcfs", "fcfs") as server:
            base = server.base
            interactive(base, args, 2 * args.interval, "warm")
            batch_id = start_batch(base, args)
            window = Window(base)
            fifo = interactive(base, args, args.phase, "fifo")
            phases["batch + interactive (fcfs)"] = {**summary(fifo), **window.close()}
            cancel_batch(base, batch_id)
    idle = phases["idle"]
    rows = []
    for name, phase in phases.items():
        n = phase.get("n")
        rows.append([name, n if n is not None else "", *(round(phase[k] * 1000) if n else "" for k in ("p50_s", "p95_s")),
                     round(phase["p50_s"] / idle["p50_s"], 2) if n else "", phase["batch_tokens_per_s"], phase["mean_step_ms"]])
    throughput = phases["batch + interactive (priority)"]["batch_tokens_per_s"] / phases["batch alone"]["batch_tokens_per_s"]
    report.figure("phases", phases)
    report.figure("batch_throughput_beside_vs_alone", throughput)
    report.table(f"Interactive requests beside a Batch API batch, --parallel {args.parallel}",
                 ["phase", "requests", "TTFT p50 (ms)", "TTFT p95 (ms)", "p50 / idle", "batch tokens/s", "mean step (ms)"], rows,
                 f"The batch keeps {throughput:.3f} of its tokens/s beside the interactive load (mean of 2 alternating rounds).")


def _mean(windows: list[dict]) -> dict:
    return {key: float(np.mean([w[key] for w in windows])) for key in windows[0]} | {
        "rounds": [round(w["batch_tokens_per_s"], 1) for w in windows]}
