"""Nothing lost under operations: a Batch API batch SIGKILLed at random moments under a storm of streaming clients.

One `llamabatch serve --data-dir` runs a batch of --lines completion lines while --clients
streaming clients come and go (each asks --requests times, again as soon as it is answered;
--hangup of the streams are hung up mid-stream). The server is killed with SIGKILL --kills times
at random moments while the batch runs, and started again on the same port and folder; the batch
resumes there. At the end:
  - every line of the batch is answered exactly once (output and error files together), none failed;
  - no answer was a server error but 503 while the server was loading (clients of a killed server
    see their connection drop, which is counted apart);
  - the server's log holds no traceback.
Figures: wall time, lines per second, the kills, the streams answered, cut by a kill, hung up.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from .harness import cli, model_path, progress, tiny_model
from .servers import free_port, wait_healthy

SMOKE = ["--model", "tiny", "--lines", "300", "--kills", "1", "--kill-every", "0.3", "--clients", "8", "--requests", "2"]


def arguments(parser) -> None:
    parser.add_argument("--model", default="tiny", help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--requests", type=int, default=4, help="streams each client asks for, one after another")
    parser.add_argument("--kill-every", type=float, default=1.0, help="mean seconds between kills (drawn uniformly, up to twice that)")
    parser.add_argument("--hangup", type=float, default=0.3, help="share of streams whose client hangs up mid-stream")
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)


class Served:
    """The server process, killed and started again on one port and data folder; its log kept."""

    def __init__(self, model: Path, folder: Path, parallel: int) -> None:
        self.port, self.folder = free_port(), folder
        self.base = f"http://127.0.0.1:{self.port}"
        self.command = cli("serve", "-m", model, "--data-dir", folder / "data", "--port", self.port, "--parallel", parallel,
                           "--threads", 2, "--max-queue", 1024)
        self.log = folder / "server.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=log)
        wait_healthy(self.base, self.process)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)


class Tally:
    def __init__(self) -> None:
        self.answered = self.hung_up = self.dropped = self.loading = self.refused = 0
        self.errors: list[str] = []  # server errors other than 503 while loading


async def streams(base: str, k: int, requests: int, tally: Tally, hangup: float, rng: random.Random) -> None:
    body = {"prompt": f"client {k} says", "max_tokens": 24, "temperature": 0.7, "stream": True}
    asked = 0
    async with httpx.AsyncClient(timeout=120) as client:
        while asked < requests:
            leave_after = rng.randint(1, 20) if rng.random() < hangup else None
            try:
                async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                    if r.status_code >= 500:
                        text = (await r.aread()).decode(errors="replace")
                        if r.status_code == 503 and ("loading" in text or "not loaded" in text):
                            tally.loading += 1
                        else:
                            tally.errors.append(f"{r.status_code}: {text[:200]}")
                        await asyncio.sleep(0.2)
                        continue
                    if r.status_code != 200:  # 429: the queue is full for now
                        tally.refused += 1
                        await asyncio.sleep(0.1)
                        continue
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: {")
                        if '"error"' in line:
                            tally.errors.append(line[:200])
                        if leave_after is not None and n >= leave_after:
                            break
                    asked += 1
                    if leave_after is not None and n >= leave_after:
                        tally.hung_up += 1
                    else:
                        tally.answered += 1
            except httpx.TransportError:  # the server was killed under it
                tally.dropped += 1
                await asyncio.sleep(0.2)


async def storm(args, served: Served, batch_id: str, rng: random.Random) -> tuple[Tally, int, dict]:
    tally = Tally()
    clients = [asyncio.ensure_future(streams(served.base, k, args.requests, tally, args.hangup, random.Random(rng.random())))
               for k in range(args.clients)]
    kills = 0
    async with httpx.AsyncClient(timeout=60) as client:
        while True:
            await asyncio.sleep(rng.uniform(0.0, 2 * args.kill_every))
            try:
                batch = (await client.get(f"{served.base}/v1/batches/{batch_id}")).json()
            except httpx.TransportError:
                continue
            if batch["status"] in ("completed", "failed", "cancelled", "expired"):
                break
            if kills < args.kills:
                served.kill()
                kills += 1
                progress(f"killed ({kills} of {args.kills}) at {batch['request_counts']['completed']} of {args.lines} lines")
                await asyncio.to_thread(served.start)
    await asyncio.gather(*clients)
    return tally, kills, batch


def run(args, report) -> None:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = tiny_model(folder) if args.model == "tiny" else model_path(args.model)
        served = Served(model, folder, args.parallel)
        served.start()
        try:
            lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                      "body": {"prompt": f"Line {i}:", "max_tokens": 8, "temperature": 0}} for i in range(args.lines)]
            data = "".join(json.dumps(line) + "\n" for line in lines).encode()
            file = httpx.post(f"{served.base}/v1/files", files={"file": ("storm.jsonl", io.BytesIO(data))}, data={"purpose": "batch"}).json()
            started = time.perf_counter()
            batch = httpx.post(f"{served.base}/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/completions",
                                                                  "completion_window": "24h"}).json()
            tally, kills, batch = asyncio.run(storm(args, served, batch["id"], rng))
            wall = time.perf_counter() - started
            ids = []
            for key in ("output_file_id", "error_file_id"):
                if batch.get(key):
                    text = httpx.get(f"{served.base}/v1/files/{batch[key]}/content", timeout=120).text
                    ids += [json.loads(row)["custom_id"] for row in text.splitlines() if row]
        finally:
            served.stop()
        log = served.log.read_text(errors="replace")
    expected = {line["custom_id"] for line in lines}
    missing, repeated = len(expected - set(ids)), len(ids) - len(set(ids))
    tracebacks = log.count("Traceback")
    report.figure("lines", args.lines)
    report.figure("kills", kills)
    report.figure("missing", missing)
    report.figure("repeated", repeated)
    report.figure("failed_lines", batch["request_counts"]["failed"])
    report.figure("server_errors", len(tally.errors))
    report.figure("tracebacks", tracebacks)
    report.table(
        f"A {args.lines}-line batch, SIGKILLed {kills} times, under {args.clients} streaming clients ({args.hangup:.0%} hang up)",
        ["batch status", "lines answered", "missing", "answered twice", "failed lines", "wall (s)", "lines/s",
         "streams answered", "hung up", "cut by a kill", "503 while loading", "429", "other 5xx", "tracebacks in the log"],
        [[batch["status"], len(set(ids)), missing, repeated, batch["request_counts"]["failed"], round(wall, 1),
          round(args.lines / wall, 1), tally.answered, tally.hung_up, tally.dropped, tally.loading, tally.refused,
          len(tally.errors), tracebacks]],
        f"--parallel {args.parallel}; each line 8 greedy tokens; each client {args.requests} streams of 24 sampled tokens; seed {args.seed}.",
    )
    problems = [f"{missing} lines missing"] * bool(missing) + [f"{repeated} answered twice"] * bool(repeated)
    problems += [f"server errors: {tally.errors[:3]}"] * bool(tally.errors) + [f"{tracebacks} tracebacks in the server log"] * bool(tracebacks)
    problems += [f"the batch ended {batch['status']}"] * (batch["status"] != "completed")
    if problems:
        raise AssertionError("; ".join(problems))
