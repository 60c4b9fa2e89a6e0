"""Does an open web page cost the server? Serving throughput with the page open in a browser against without.

Each round, a fresh `llamabatch serve` on --clients slots is load-tested (as the serving
benchmark does: --clients streaming clients, --requests in all of --max-tokens tokens); on the
"page open" side, headless Chromium has the server's page open meanwhile, refreshing once a
second (GET /v1/dashboard and /v1/batches). Sides alternate; the figure is the ratio of output
tokens per second, page open over without, in the same round.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .browser import CHROMIUM, Browser
from .harness import Spread, alternate, model_path, paired, tiny_model
from .loadtest import load
from .servers import llamabatch_serve

SMOKE = ["--model", "tiny", "--rounds", "1", "--requests", "8", "--max-tokens", "16"]


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64, help="in all, shared by the clients")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)


def run(args, report) -> None:
    if CHROMIUM is None:
        raise RuntimeError("no chromium (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        gguf = tiny_model(Path(tmp)) if args.model == "tiny" else model_path(args.model)
        per_client = max(1, args.requests // args.clients)

        def side(page: bool) -> dict:
            with llamabatch_serve(gguf, "--parallel", args.clients, "--ctx", 256 * args.clients, "-t", args.threads,
                                  "--data-dir", Path(tmp) / "data") as server:
                load(server.base, clients=args.clients, requests=1, max_tokens=4)  # warm-up
                if not page:
                    return load(server.base, clients=args.clients, requests=per_client, max_tokens=args.max_tokens)
                with Browser.started() as browser:
                    browser.open(server.base + "/")
                    browser.wait("document.querySelectorAll('#models tr.model').length > 0")
                    result = load(server.base, clients=args.clients, requests=per_client, max_tokens=args.max_tokens)
                    result["page_readings"] = browser.js("(readingsOf[Object.keys(readingsOf)[0]] || []).length")
                    return result

        runs = alternate({"without": lambda: side(False), "page open": lambda: side(True)}, args.rounds, label="page")
    for name, results in runs.items():
        if any(r["errors"] or r["incomplete"] for r in results):
            raise RuntimeError(f"{name} failed or cut requests: {results}")
    ratio = paired([r["output_tokens_per_s"] for r in runs["page open"]], [r["output_tokens_per_s"] for r in runs["without"]])
    report.figure("page_open_over_without", ratio)
    report.table(
        f"Serving throughput with the web page open, {Path(gguf).name}, {args.clients} clients = slots",
        ["side", "output tokens/s", "page readings during the load"],
        [["without", Spread.of([r["output_tokens_per_s"] for r in runs["without"]]), ""],
         ["page open", Spread.of([r["output_tokens_per_s"] for r in runs["page open"]]),
          Spread.of([r["page_readings"] for r in runs["page open"]])],
         ["page open / without, same round", ratio, ""]],
        f"Medians (lowest–highest) of {args.rounds} alternating rounds, each a fresh server; {args.requests} requests of "
        f"{args.max_tokens} greedy tokens; the page refreshes once a second in headless Chromium.",
    )
