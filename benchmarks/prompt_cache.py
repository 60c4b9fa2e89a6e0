"""Prompt cache tiers: time to first token for a request sharing a long prefix, cold, from RAM, from disk after a restart.

Each round, on one model and settings:
  cold   a fresh engine without a cache runs PREFIX + question (one for the RAM side, one for the disk side);
  ram    an engine with --cache-ram and --cache-dir runs PREFIX + an earlier question, then --other
         long unrelated prompts, which take every slot, then PREFIX + question: its prefix comes
         back from the RAM tier (the first reuse: no request before it learned where prompts part);
  disk   the same up to the unrelated prompts, then that engine is closed, a new one opens the same
         --cache-dir (its RAM tier empty), and runs PREFIX + another question: its prefix comes
         back from the disk tier (again the first reuse).
Time to first token is from submission to the first sampled token, in the engine (no HTTP).
Every restored run's greedy tokens are compared with its cold run's. The cache folder is read
back through the page cache, as after a process restart on a host that kept running.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from llamabatch import BatchEngine, SamplingParams

from .harness import Spread, model_path, paired, progress, tiny_model

SMOKE = ["--model", "tiny", "--prefix", "300", "--other", "200", "--rounds", "1", "--tokens", "4"]

TEXT = Path("/usr/share/common-licenses/GPL-3")


def tokens_of(engine: BatchEngine, text: str, n: int, bos: bool) -> list[int]:
    """n tokens of text (repeated as needed)."""
    tokens = engine.model.vocab.tokenize(text, add_special=bos)
    while len(tokens) < n:
        tokens += engine.model.vocab.tokenize(text, add_special=False)
    return tokens[:n]


def first_token(engine: BatchEngine, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    """Seconds from submission to the first token, and the greedy tokens."""
    started = time.perf_counter()
    [seq] = engine.submit([prompt], params)
    ttft = None
    while engine.has_work:
        events = engine.step()
        if ttft is None and any(e.token is not None for e in events):
            ttft = time.perf_counter() - started
    if seq.error:
        raise RuntimeError(seq.error)
    return ttft, seq.tokens[seq.n_prompt:]


def warm(engine: BatchEngine) -> None:
    """A first decode, so that no side's measured request pays a fresh engine's first-step costs."""
    engine.generate([[engine.model.vocab.bos] * 4], SamplingParams(temperature=0, max_tokens=2))


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--prefix", type=int, default=2000, help="tokens the requests share")
    parser.add_argument("--other", type=int, default=1500, help="tokens of each unrelated prompt that takes a slot")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per request (compared with the cold run's)")
    parser.add_argument("--cache-ram", default="4GiB")
    parser.add_argument("--threads", type=int, default=os.cpu_count())


def run(args, report) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    text = TEXT.read_text() if TEXT.is_file() else Path(__file__).read_text()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model(Path(tmp))) if args.model == "tiny" else str(model_path(args.model))
        settings = dict(n_parallel=args.parallel, n_ctx=args.parallel * (args.prefix + args.other + 256), n_threads=args.threads)
        with BatchEngine(model, **settings) as probe:
            prefix = tokens_of(probe, text, args.prefix, bos=True)
            others = [tokens_of(probe, text[5000 * (k + 1):], args.other, bos=True) for k in range(args.parallel)]
            asks = {f"{r}-{tag}": prefix + tokens_of(probe, f"\n\nQuestion {r}{tag}: which section names the licensor?", 24, bos=False)
                    for r in range(args.rounds) for tag in ("earlier", "ram", "disk")}

        ttfts: dict[str, list[float]] = {"cold ram": [], "cold disk": [], "ram": [], "disk": []}
        same = {"ram": True, "disk": True}
        entry_bytes = 0
        for r in range(args.rounds):
            progress(f"round {r + 1} of {args.rounds}")
            asked = {"ram": asks[f"{r}-ram"], "disk": asks[f"{r}-disk"]}
            cold = {}
            for side in ("ram", "disk"):
                with BatchEngine(model, **settings) as engine:
                    warm(engine)
                    t, cold[side] = first_token(engine, asked[side], greedy)
                    ttfts[f"cold {side}"].append(t)
            for side in ("ram", "disk"):  # each the first reuse: no request before it parted from the prefix
                folder = Path(tmp) / f"cache-{r}-{side}"
                with BatchEngine(model, cache_ram=args.cache_ram, cache_dir=folder, **settings) as engine:
                    first_token(engine, asks[f"{r}-earlier"], greedy)
                    engine.generate(others, greedy)  # every slot taken: the prefix is in the tiers only
                    if side == "ram":
                        t, got = first_token(engine, asked["ram"], greedy)
                        assert engine.prompt_cache.stats.ram.hits == 1, engine.prompt_cache.stats
                        entry_bytes = engine.prompt_cache.stats.ram.bytes // max(1, engine.prompt_cache.stats.ram.entries)
                if side == "disk":
                    with BatchEngine(model, cache_ram=args.cache_ram, cache_dir=folder, **settings) as engine:
                        warm(engine)
                        t, got = first_token(engine, asked["disk"], greedy)
                        assert engine.prompt_cache.stats.disk.hits == 1, engine.prompt_cache.stats
                ttfts[side].append(t)
                same[side] &= got == cold[side]

    ram, disk = paired(ttfts["ram"], ttfts["cold ram"]), paired(ttfts["disk"], ttfts["cold disk"])
    report.figure("ttft_ram_over_cold", ram)
    report.figure("ttft_disk_over_cold", disk)
    report.figure("same_tokens", same)
    rows = [
        ["cold (no cache)", Spread.of(ttfts["cold ram"] + ttfts["cold disk"]), "", ""],
        ["RAM tier", Spread.of(ttfts["ram"]), ram, same["ram"]],
        ["disk tier, after a restart", Spread.of(ttfts["disk"]), disk, same["disk"]],
    ]
    report.table(
        f"Time to first token (s), a request sharing a {args.prefix}-token prefix whose slot went to other work",
        ["where the prefix came from", "TTFT (s)", "/ cold, same round", "greedy tokens = cold run's"], rows,
        f"Medians (lowest–highest) of {args.rounds} rounds; --parallel {args.parallel}, {args.tokens} greedy tokens, "
        f"a kept prompt's entry about {entry_bytes / 2**20:.1f} MiB.",
    )
