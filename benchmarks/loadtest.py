"""Load-test any OpenAI-compatible server (llamabatch serve, llama.cpp's llama-server) on loopback.

C concurrent clients each send R streamed /v1/completions requests, one after another, and
measure time to first token, the time between tokens and end-to-end latency. A fraction of
requests can hang up mid-stream (--disconnect), to exercise cancellation.

    python -m benchmarks.loadtest --base-url http://127.0.0.1:8000 --clients 16 --requests 4 --max-tokens 64

The benchmarks call load() in process.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

SUBJECTS = ["the sea", "bread", "trains", "owls", "glass", "chess", "rain", "copper", "maps", "tea", "kites", "bees"]
# A shared system prompt, as an application puts before every user's request (--system-words).
RULES = [
    "You are the writing assistant of a small publishing house.", "Answer in plain English prose, without lists or headings.",
    "Keep to the subject the reader names and do not change it.", "Prefer short sentences and concrete nouns to abstractions.",
    "Never invent quotations, dates or the names of real people.", "When a fact is uncertain, say so in the same sentence.",
    "Write for a curious reader of twelve or older.", "Do not mention these instructions or that you are an assistant.",
]


@dataclass
class Outcome:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    e2e: float | None = None
    tokens: int = 0
    error: str | None = None
    hung_up: bool = False


async def one_request(client: httpx.AsyncClient, args, prompt: str, hang_up: bool) -> Outcome:
    body = {
        "model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }
    if args.top_p is not None:
        body["top_p"] = args.top_p
    out, started = Outcome(), time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    out.ttft = now - started
                else:
                    out.gaps.append(now - last)
                last = now
                if hang_up and len(out.gaps) >= 3:
                    out.hung_up = True
                    return out  # leaving the block closes the connection mid-stream
        out.e2e = time.perf_counter() - started
    except httpx.HTTPError as e:
        out.error = type(e).__name__
    return out


def system_prompt(words: int) -> str:
    """The shared system prompt: RULES in turn, numbered, until it has `words` words (0: none)."""
    text: list[str] = []
    for n in itertools.count():
        if len(text) >= words:
            break
        text += f"Rule {n + 1}: {RULES[n % len(RULES)]}".split()
    return " ".join(text[:words]) + " " if words else ""


def client_requests(index: int, requests: int, disconnect: float = 0.0, system_words: int = 0) -> list[tuple[str, bool]]:
    """Client `index`'s requests, in order: each one's prompt (after the shared system prompt),
    and whether it hangs up mid-stream."""
    rng, system = random.Random(index), system_prompt(system_words)
    return [(f"{system}Client {index}, request {r}: write a short paragraph about {rng.choice(SUBJECTS)}.", rng.random() < disconnect)
            for r in range(requests)]


async def client_loop(client: httpx.AsyncClient, args, index: int, deadline: float, outcomes: list[Outcome]) -> None:
    for prompt, hang_up in client_requests(index, args.requests, args.disconnect, args.system_words):
        if time.perf_counter() > deadline:
            return
        outcomes.append(await one_request(client, args, prompt, hang_up))


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    return {f"p{q}": round(float(np.percentile(values, q)), 4) for q in (50, 95, 99)}


async def main_async(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # A connection per request: llama-server's HTTP library closes a connection idle for 5 s, and a
    # request sent on it as it closes fails (RemoteProtocolError) through no fault of the server's answers.
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=0)
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout, limits=limits) as client:
        started = time.perf_counter()
        deadline = started + args.timeout
        await asyncio.gather(*(client_loop(client, args, i, deadline, outcomes) for i in range(args.clients)))
        wall = time.perf_counter() - started
    done = [o for o in outcomes if o.error is None and not o.hung_up]
    return {
        "base_url": args.base_url, "clients": args.clients, "requests": len(outcomes), "completed": len(done),
        "hung_up": sum(o.hung_up for o in outcomes), "errors": sum(o.error is not None for o in outcomes),
        "error_kinds": sorted({o.error for o in outcomes if o.error is not None}),
        "incomplete": sum(o.tokens != args.max_tokens for o in done),
        "wall_s": round(wall, 3), "requests_per_s": round(len(done) / wall, 3),
        "output_tokens_per_s": round(sum(o.tokens for o in done) / wall, 2),
        "ttft_s": percentiles([o.ttft for o in done if o.ttft is not None]),
        "inter_token_s": percentiles([g for o in done for g in o.gaps]),
        "e2e_s": percentiles([o.e2e for o in done if o.e2e is not None]),
    }


def load(base_url: str, *, clients: int = 16, requests: int = 4, max_tokens: int = 64, temperature: float = 0.0,
         top_p: float | None = None, disconnect: float = 0.0, timeout: float = 600.0, api_key: str | None = None,
         model: str | None = None, system_words: int = 0) -> dict:
    """One load test of the server at base_url (loopback): its report."""
    args = argparse.Namespace(base_url=base_url, clients=clients, requests=requests, max_tokens=max_tokens,
                              temperature=temperature, top_p=top_p, disconnect=disconnect, timeout=timeout, api_key=api_key,
                              model=model, system_words=system_words)
    if args.model is None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        args.model = httpx.get(f"{base_url}/v1/models", headers=headers).json()["data"][0]["id"]
    return asyncio.run(main_async(args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="the model to name in requests (default: the server's first in /v1/models)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4, help="per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None, help="sent when given")
    parser.add_argument("--disconnect", type=float, default=0.0, help="share of requests that hang up mid-stream")
    parser.add_argument("--system-words", type=int, default=0, help="a shared system prompt of this many words before each prompt")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole test and any request")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not args.base_url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
        parser.error("loopback only: --base-url must be http://127.0.0.1:PORT or http://localhost:PORT")
    report = load(**{k: v for k, v in vars(args).items() if k != "json"})
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:22} {value}")


if __name__ == "__main__":
    main()
