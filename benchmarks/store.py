"""Streams beside Batch API traffic: do the store's commits (SQLite, fsync) stretch a stream's gaps?

One `llamabatch serve --data-dir` with --slots slots: --streams streamed completions generate
(greedy, EOS ignored, --stream-tokens each). On the "churn" side a client meanwhile uploads a
small batch input, creates a batch on it, cancels it and reads it back, every --pace seconds,
until the streams end: every route of the Batch API that commits. Measured on the streams' tokens as the
client receives them: the median, p99 and worst gap, and the store operations done. Sides
alternate, a fresh server and data folder each; --before DIR adds "churn@before", the server of
another checkout under the same churn.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import tempfile
import threading
from pathlib import Path

import httpx
import numpy as np

from .harness import Spread, alternate, model_path, paired, tiny_model
from .servers import llamabatch_serve
from .stall import Stream

SMOKE = ["--model", "tiny", "--rounds", "1", "--streams", "2", "--stream-tokens", "200"]


def arguments(parser) -> None:
    parser.add_argument("--model", default="tiny", help="catalog name or GGUF path; 'tiny' (default) for the tests' model, whose fast steps show a stall best")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--stream-tokens", type=int, default=1500)
    parser.add_argument("--pace", type=float, default=0.05, help="seconds between one batch's round trip and the next")
    parser.add_argument("--before", type=Path, default=None, help="another checkout: its server under the same churn")
    parser.add_argument("--rounds", type=int, default=3)


class Churn(threading.Thread):
    """Upload, create, cancel and read back batches until stopped; counts the requests made."""

    def __init__(self, base: str, pace_s: float) -> None:
        super().__init__(daemon=True)
        self.base, self.pace_s, self.stop, self.requests, self.error = base, pace_s, threading.Event(), 0, None
        line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}}
        self.input = (json.dumps(line) + "\n").encode()

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=120) as client:
            while not self.stop.is_set():
                try:
                    uploaded = client.post("/v1/files", files={"file": ("in.jsonl", io.BytesIO(self.input))}, data={"purpose": "batch"})
                    batch = client.post("/v1/batches", json={"input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions",
                                                             "completion_window": "24h"}).json()
                    client.post(f"/v1/batches/{batch['id']}/cancel").raise_for_status()
                    client.get(f"/v1/batches/{batch['id']}").raise_for_status()
                except (httpx.HTTPError, KeyError) as e:
                    self.error = f"{type(e).__name__}: {e}"
                    return
                self.requests += 4
                self.stop.wait(self.pace_s)


def experiment(base: str, args, churn: bool) -> dict:
    streams = [Stream(base, f"Story {i}: once upon a time, in a town by the sea,", args.stream_tokens) for i in range(args.streams)]
    traffic = Churn(base, args.pace) if churn else None
    for thread in [*streams, *([traffic] if traffic else [])]:
        thread.start()
    for stream in streams:
        stream.join()
    if traffic is not None:
        traffic.stop.set()
        traffic.join()
        if traffic.error:
            raise RuntimeError(f"the Batch API traffic failed at {base}: {traffic.error}")
    failed = [s.error for s in streams if s.error or not s.times]
    if failed:
        raise RuntimeError(f"streams failed at {base}: {failed}")
    start = max(s.times[0] for s in streams)  # every stream generating, the churn running
    gaps = [b - a for s in streams for a, b in zip(s.times, s.times[1:]) if a >= start]
    return {"median_gap_s": statistics.median(gaps), "p99_gap_s": float(np.percentile(gaps, 99)), "worst_gap_s": max(gaps),
            "store_requests": traffic.requests if traffic else 0}


def run(args, report) -> None:
    sides = {"quiet": (None, False), "churn": (None, True)}
    if args.before is not None:
        sides["churn@before"] = (args.before.resolve(), True)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = tiny_model(Path(tmp)) if args.model == "tiny" else model_path(args.model)

        def measure(tree: Path | None, churn: bool):
            def once() -> dict:
                with tempfile.TemporaryDirectory() as data:
                    env = {"PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])} if tree else None
                    server = llamabatch_serve(gguf, "--parallel", args.slots, "--ctx", 4096, "--data-dir", data, "-t", 2, env=env)
                    with server as running:
                        return experiment(running.base, args, churn)
            return once

        runs = alternate({side: measure(*how) for side, how in sides.items()}, args.rounds, label="store")
    rows = []
    for side, results in runs.items():
        worst = [r["worst_gap_s"] for r in results]
        rows.append([side, Spread.of([r["median_gap_s"] * 1e3 for r in results]), Spread.of([r["p99_gap_s"] * 1e3 for r in results]),
                     Spread.of([w * 1e3 for w in worst]), paired(worst, [r["worst_gap_s"] for r in runs["quiet"]]),
                     Spread.of([r["store_requests"] for r in results])])
        report.figure(f"{side.replace('@', '_')}_worst_over_quiet", paired(worst, [r["worst_gap_s"] for r in runs["quiet"]]))
        report.figure(f"{side.replace('@', '_')}_p99_over_quiet", paired([r["p99_gap_s"] for r in results],
                                                                         [r["p99_gap_s"] for r in runs["quiet"]]))
    report.table(
        f"{Path(gguf).name}: {args.streams} streams of {args.stream_tokens} tokens, {args.slots} slots, beside Batch API "
        "traffic (upload, create, cancel, read back) or none",
        ["side", "median gap (ms)", "p99 gap (ms)", "worst gap (ms)", "worst / quiet's", "store requests"], rows,
        f"Medians (lowest–highest) of {args.rounds} alternating rounds, a fresh server and data folder each; ratios paired within rounds.",
    )
