"""Speculative decoding (n-gram prompt lookup, a draft model) against none, on the default model.

grounded   16 prompts "Copy the following text, fixing its spelling:" with 200-400-token
           passages (misspelt words every so often), greedy, --max-tokens 192, at B = 1 and 4
open       stories from short prompts, greedy, 64 tokens, at B = 16 and 32

Each (workload, B) runs every mode in an engine of its own, alternating the order over --repeat
rounds; generated tokens/s is the engine's (steps' wall time, drafting included), the median is
printed with the acceptance rate and tokens per llama_decode. Outputs are compared token for token.
`--modes off,draft --draft-model PATH` measures a draft model; `--force-drafts K` makes every
sequence draft K tokens every step (the planner's choice taken away: the raw cost of drafting).

"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from llamabatch import BatchEngine, SamplingParams

from .harness import Spread, alternate, paired, tiny_model

SMOKE = ["--model", "tiny", "--rounds", "1", "--cases", "grounded:1,open:2", "--max-tokens", "16"]

SENTENCES = [
    "The library opens at nine in the morning and closes at six in the evening on weekdays.",
    "Visitors are asked to keep their voices low in the reading rooms on the second floor.",
    "The old bridge over the river was built in the eighteenth century and repaired twice since.",
    "Our team will meet on Thursday to discuss the budget for the coming year and the new hires.",
    "Please remember to bring your own water bottle, since the fountains are being replaced.",
    "The garden behind the museum is full of roses, tulips and a small pond with goldfish.",
    "Each student must submit the report before the end of the month, signed by a teacher.",
    "The train to the coast leaves every hour from platform four and takes about ninety minutes.",
    "Fresh bread is delivered to the shop early every morning, except on public holidays.",
    "The committee agreed that the park needs more benches, better lights and a new playground.",
    "Heavy rain is expected over the weekend, so the outdoor concert has been moved indoors.",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and a little warm milk.",
    "After the meeting, the manager thanked everyone for their patience during the long project.",
    "The mountain path is steep and narrow, and walkers should wear strong boots in winter.",
    "Our neighbours adopted a young dog that loves to chase the ball across the whole garden.",
    "The new software update fixes several bugs and makes the application start much faster.",
]
STORY_STARTS = ["Once upon a time", "The dragon woke up", "In a small village", "The last robot on Earth",
                "She opened the letter", "Deep under the sea", "The wizard's apprentice", "On the first day of school"]


def misspell(text: str, every: int) -> str:
    words = text.split(" ")
    for i in range(3, len(words), every):
        w = words[i]
        if len(w) > 4 and w.isalpha():
            words[i] = w[0] + w[2] + w[1] + w[3:]  # swap two letters
    return " ".join(words)


def grounded_prompts(n: int = 16) -> list[str]:
    prompts = []
    for i in range(n):
        count = 11 + (i * 5) % 8  # 11..18 sentences: a passage of about 200-400 tokens
        passage = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(count))
        prompts.append(f"Copy the following text, fixing its spelling:\n\n{misspell(passage, 7)}\n\nCorrected text:\n\n")
    return prompts


def open_prompts(n: int) -> list[str]:
    return [f"{STORY_STARTS[i % len(STORY_STARTS)]} ({i})," for i in range(n)]


def measure(args: argparse.Namespace, prompts: list[str], parallel: int, mode: str, max_tokens: int) -> dict:
    draft_model = args.draft_model if mode == "draft" else None
    with BatchEngine(args.model, n_parallel=parallel, n_ctx=parallel * 1024, speculative=mode, draft_model=draft_model) as engine:
        if args.force_drafts and engine.speculator is not None:
            engine.speculator.planner.plan = lambda n_rows, states: [args.force_drafts] * len(states)
        engine.generate(prompts[:parallel], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        engine.drop_cached_prefixes()
        engine.reset_stats()
        results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
        s = engine.stats
        return {"tok_s": s.tokens_per_s, "acceptance": s.acceptance_rate, "drafted": s.draft_tokens,
                "tokens_per_decode": s.completion_tokens / s.decode_calls, "tokens": [r.token_ids for r in results]}


def arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="off,ngram", help="'off' first, then the modes it is compared with")
    parser.add_argument("--draft-model", help="for the 'draft' mode")
    parser.add_argument("--force-drafts", type=int, default=0, help="every sequence drafts K tokens every step (the planner's choice taken away)")
    parser.add_argument("--cases", default="grounded:1,grounded:4,open:16,open:32")
    parser.add_argument("--max-tokens", type=int, default=None, help="(default: grounded 192, open 64)")


def run(args, report) -> None:
    modes = args.modes.split(",")
    workloads = {"grounded": (grounded_prompts(), args.max_tokens or 192), "open": (open_prompts(64), args.max_tokens or 64)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            args.model = str(tiny_model(Path(tmp)))
        for case in args.cases.split(","):
            name, parallel = case.split(":")
            prompts, max_tokens = workloads[name]
            runs = alternate({m: (lambda m=m: measure(args, prompts, int(parallel), m, max_tokens)) for m in modes},
                             args.rounds, label=f"{name} B={parallel}")
            base = [x["tok_s"] for x in runs[modes[0]]]
            for m in modes:
                first = runs[m][0]
                same = all(x["tokens"] == runs[modes[0]][0]["tokens"] for x in runs[m])
                speedup = paired([x["tok_s"] for x in runs[m]], base)
                rows.append([name, parallel, m, Spread.of([x["tok_s"] for x in runs[m]]), speedup, first["acceptance"],
                             first["tokens_per_decode"], "yes" if same else "no"])
                if m != modes[0]:
                    report.figure(f"speedup_{m}_{name}_{parallel}", speedup)
    report.table("Speculative decoding: generated tokens/s (greedy)",
                 ["workload", "B", "mode", "tokens/s", f"vs {modes[0]}", "acceptance", "tokens per decode", f"same tokens as {modes[0]}"],
                 rows, f"Medians (lowest–highest) of {args.rounds} rotating rounds, an engine per run.")
