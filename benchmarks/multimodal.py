"""A captioning job: --images distinct images, each asked about once, against llama-server --mmproj.

The text model (default: the default model) with a random-weight projector of LLaVA's kind
written here for its n_embd (clip.cpp's "mlp": a --vit-layers-layer ViT of width --vit-embd on
--image-size² images in 14-pixel patches, so (image-size / 14)² positions an image); random
noise images made here, all different. Every request is a chat with one text part and one
image_url part (a data: URL), greedy, --max-tokens tokens with EOS ignored, ChatML on both sides.
Sides alternate, a fresh process each: `llamabatch batch` over the job file (its own wall time,
without loading, as the servers' runs exclude theirs), `llamabatch serve`
and llama-server (-np --slots -kvu) each driven by --clients clients. Figures: images a second
(requests done over the wall time from the first request to the last answer); and, in process,
one image asked about by 8 questions: how many times it was encoded and read into memory.

Beside them, each round, the most llama.cpp computes of the job's text side: llama-batched-bench
with --slots sequences each reading as many prompt tokens as one request does beyond the prefix
all requests share (the image's positions and the text after it) and generating --max-tokens,
the same threads, once for every --slots images. It skips the image encoder, reads every prompt
in one batch and never waits for a request, so no side can pass it: it bounds what any side can
have over llama-server.

A random ViT is a small one, so encoding costs less than a real one's: the figures weigh the
text side and the handling of images, not a vision tower's speed.
"""

from __future__ import annotations

import base64
import io
import json
import math
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from llamabatch.measure.sweep import batched_bench

from .harness import Spread, alternate, cli, model_path, paired, tiny_model, tiny_models
from .servers import llama_server, llamabatch_serve, native

SMOKE = ["--model", "tiny", "--rounds", "1", "--images", "8", "--clients", "2", "--slots", "2", "--max-tokens", "4",
         "--image-size", "28", "--vit-embd", "32", "--vit-layers", "1"]
SIDES = ("llamabatch:batch", "llamabatch:serve", "llama-server", "batched-bench")
QUESTION = "Describe this image in one sentence."


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path (default: the default model); 'tiny' for the tests' model")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=112, help="pixels a side the projector reads (14-pixel patches)")
    parser.add_argument("--vit-embd", type=int, default=256)
    parser.add_argument("--vit-layers", type=int, default=4)
    parser.add_argument("--sides", default=",".join(SIDES), help=f"of {', '.join(SIDES)}")
    parser.add_argument("--rounds", type=int, default=3)


def images(n: int) -> list[bytes]:
    """n different 64×64 PNGs of noise."""
    from PIL import Image

    rng = np.random.default_rng(0)
    made = []
    for _ in range(n):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buffer, "PNG")
        made.append(buffer.getvalue())
    return made


def body(image: bytes, max_tokens: int) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def drive(base: str, bodies: list[dict], clients: int) -> float:
    """Every body sent by `clients` clients, each taking the next; the wall time of them all."""
    queue = list(reversed(bodies))
    lock = threading.Lock()
    failed: list[str] = []

    def client() -> None:
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    if not queue:
                        return
                    request = queue.pop()
                answer = http.post(f"{base}/v1/chat/completions", json=request)
                if answer.status_code != 200 or answer.json()["usage"]["completion_tokens"] != request["max_tokens"]:
                    failed.append(answer.text[:300])

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed at {base}: {failed[0]}")
    return time.perf_counter() - started


def batch_job(gguf: Path, projector: Path, bodies: list[dict], args, work: Path) -> float:
    return run_batch(gguf, projector, bodies, args, work)[0]["wall_s"]  # the job's own time: the servers' exclude loading too


def run_batch(gguf: Path, projector: Path, bodies: list[dict], args, work: Path, slots: int | None = None) -> tuple[dict, list[dict]]:
    """`llamabatch batch` over the bodies, every line checked: its summary and its answers."""
    source = work / "job.jsonl"
    source.write_text("".join(json.dumps({"custom_id": f"image-{k}", "method": "POST", "url": "/v1/chat/completions", "body": b}) + "\n"
                              for k, b in enumerate(bodies)))
    out = work / f"out-{time.monotonic_ns()}.jsonl"
    done = subprocess.run(cli("batch", source, "-o", out, "-m", gguf, "--mmproj", projector, "--chat-template", "chatml",
                              "--parallel", slots or args.slots, "--ctx", ctx(args), "-t", args.threads, "--json"), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llamabatch batch failed: {done.stderr[-1000:]}")
    answered = [json.loads(line) for line in out.read_text().splitlines()]
    if len(answered) != len(bodies) or any(line["error"] for line in answered):
        raise RuntimeError(f"the batch job answered {len(answered)} of {len(bodies)} lines, or some with errors")
    return json.loads(done.stdout.splitlines()[-1])["summary"], answered


def tokens_read(gguf: Path, projector: Path, bodies: list[dict], args, work: Path) -> int:
    """The prompt tokens a request reads beyond the prefix every request shares: the second of two
    requests through one slot, which finds the first's prefix cached."""
    answers = {line["custom_id"]: line for line in run_batch(gguf, projector, bodies[:2], args, work, slots=1)[1]}
    second = answers["image-1"]["response"]["body"]["usage"]
    return second["prompt_tokens"] - second["prompt_tokens_details"]["cached_tokens"]


def batched_bench_job(gguf: Path, prompt: int, args) -> float:
    """llama-batched-bench's seconds for --images requests of this shape, --slots at a time: run as
    many times as the job has batches of --slots, so that it spans the host's drift as the sides do."""
    command = [native("llama-batched-bench"), "-m", str(gguf), "-c", str(ctx(args)), "-npp", str(prompt), "-ntg", str(args.max_tokens),
               "-npl", str(args.slots), "-t", str(args.threads), "-kvu"]
    batches = math.ceil(args.images / args.slots)
    seconds = sum(batched_bench(command, args.slots)["t"] for _ in range(batches))
    return seconds * args.images / (batches * args.slots)


def ctx(args) -> int:
    return args.slots * (256 + (args.image_size // 14) ** 2 + args.max_tokens)


def shared_image(gguf: Path, projector: Path, image: bytes) -> dict:
    """One image, 8 questions, in process: how often it was encoded and read into memory."""
    from llamabatch.engine import BatchEngine, MediaPrompt, SamplingParams

    with BatchEngine(gguf, mmproj=projector, n_parallel=8, n_ctx=8192, chat_template="chatml", chat=True) as engine:
        results = engine.generate([MediaPrompt(f"Question {k}: what is in this image?", (image,)) for k in range(8)],
                                  SamplingParams(max_tokens=4, temperature=0))
        if any(r.error for r in results):
            raise RuntimeError(f"shared image: {[r.error for r in results if r.error][0]}")
        return {"questions": 8, "media_encoded": engine.media_encoded, "media_read": engine.stats.media_read}


def n_embd(gguf: Path) -> int:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    return int(reader.fields[f"{arch}.embedding_length"].parts[-1][0])


def run(args, report) -> None:
    sides = args.sides.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        gguf = tiny_model(work) if args.model == "tiny" else model_path(args.model)
        projector = tiny_models().write_tiny_projector(work / "mmproj.gguf", n_embd_text=n_embd(gguf), n_embd=args.vit_embd,
                                                       n_layer=args.vit_layers, n_ff=4 * args.vit_embd, image_size=args.image_size)
        made = images(args.images)
        bodies = [body(image, args.max_tokens) for image in made]
        common = ["--mmproj", projector, "-t", args.threads]
        prompt = tokens_read(gguf, projector, bodies, args, work)

        def measure(side: str):
            def once() -> float:
                if side == "llamabatch:batch":
                    return batch_job(gguf, projector, bodies, args, work)
                if side == "batched-bench":
                    return batched_bench_job(gguf, prompt, args)
                if side == "llama-server":
                    server = llama_server(gguf, *common, "-np", args.slots, "-c", ctx(args), "-kvu", "--chat-template", "chatml")
                else:
                    server = llamabatch_serve(gguf, *common, "--parallel", args.slots, "--ctx", ctx(args), "--chat-template", "chatml")
                with server as running:
                    return drive(running.base, bodies, args.clients)
            return once

        runs = alternate({side: measure(side) for side in sides}, args.rounds, label="multimodal")
        shared = shared_image(gguf, projector, made[0])
    rows = []
    rates = {side: [args.images / wall for wall in walls] for side, walls in runs.items()}
    for side, rate in rates.items():
        rows.append([side, Spread.of(rate)])
        report.figure(f"{side.replace(':', '_').replace('-', '_')}_images_per_s", Spread.of(rate))
    for side in [s for s in sides if s.startswith("llamabatch:")]:
        for over in [s for s in ("llama-server", "batched-bench") if s in rates]:
            ratio = paired(rates[side], rates[over])
            rows.append([f"{side} / {over}", ratio])
            report.figure(f"{side.replace(':', '_')}_over_{over.replace('-', '_')}", ratio)
    if "batched-bench" in rates and "llama-server" in rates:  # the most any side could have over llama-server
        ratio = paired(rates["batched-bench"], rates["llama-server"])
        rows.append(["batched-bench / llama-server", ratio])
        report.figure("batched_bench_over_llama_server", ratio)
    for key, value in shared.items():
        report.figure(f"shared_image_{key}", value)
    report.table(
        f"{Path(gguf).name} with a random {args.vit_layers}-layer, {args.vit_embd}-wide ViT projector ({(args.image_size // 14) ** 2} "
        f"positions an image): {args.images} different images, one question each, {args.max_tokens} tokens; {args.slots} slots, "
        f"{args.clients} clients for the servers, {args.threads} threads",
        ["side", "images/s"], rows,
        f"Medians (lowest–highest) of {args.rounds} alternating rounds, a fresh process each; ratios paired within rounds. "
        f"batched-bench: llama-batched-bench, {args.slots} sequences of {prompt} prompt tokens (what a request reads beyond the shared "
        f"prefix) and {args.max_tokens} generated, without the image encoder. "
        f"One image asked 8 questions (in process): encoded {shared['media_encoded']}×, read into memory {shared['media_read']}×.",
    )
