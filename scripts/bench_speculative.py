#!/usr/bin/env python
"""Speculative decoding (n-gram prompt lookup, a draft model) against none, on the default model.

grounded   16 prompts "Copy the following text, fixing its spelling:" with 200-400-token
           passages (misspelt words every so often), greedy, --max-tokens 192, at B = 1 and 4
open       stories from short prompts, greedy, 64 tokens, at B = 16 and 32

Each (workload, B) runs every mode in an engine of its own, alternating the order over --repeat
rounds; generated tokens/s is the engine's (steps' wall time, drafting included), the median is
printed with the acceptance rate and tokens per llama_decode. Outputs are compared token for token.
`--modes off,draft --draft-model PATH` measures a draft model; `--force-drafts K` makes every
sequence draft K tokens every step (the planner's choice taken away: the raw cost of drafting).

    python scripts/bench_speculative.py [--repeat 2] [--model NAME] [--modes off,ngram] [--cases grounded:1,open:16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from llamabatch import BatchEngine, SamplingParams

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
        if args.force_drafts and engine.planner is not None:
            engine.planner.plan = lambda n_rows, states: [args.force_drafts] * len(states)
        engine.generate(prompts[:parallel], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        engine.drop_cached_prefixes()
        engine.reset_stats()
        results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
        s = engine.stats
        return {"tok_s": s.tokens_per_s, "acceptance": s.acceptance_rate, "drafted": s.draft_tokens,
                "tokens_per_decode": s.completion_tokens / s.decode_calls, "tokens": [r.token_ids for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--modes", default="off,ngram", help="'off' first, then the modes it is compared with")
    parser.add_argument("--draft-model", help="for the 'draft' mode")
    parser.add_argument("--force-drafts", type=int, default=0)
    parser.add_argument("--cases", default="grounded:1,grounded:4,open:16,open:32")
    args = parser.parse_args()
    modes = args.modes.split(",")
    workloads = {"grounded": (grounded_prompts(), 192), "open": (open_prompts(64), 64)}
    for case in args.cases.split(","):
        name, parallel = case.split(":")
        prompts, max_tokens = workloads[name]
        runs = {m: [] for m in modes}
        for r in range(args.repeat):
            for mode in modes[r % len(modes):] + modes[: r % len(modes)]:  # a different mode first each round
                runs[mode].append(measure(args, prompts, int(parallel), mode, max_tokens))
                print(f"{name} B={parallel} {mode}: {runs[mode][-1]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
        rate = {m: statistics.median(x["tok_s"] for x in runs[m]) for m in modes}
        row = {"workload": name, "B": int(parallel), **{f"{m}_tok_s": round(rate[m], 1) for m in modes}}
        for m in modes[1:]:
            first = runs[m][0]
            row[m] = {"speedup": round(rate[m] / rate[modes[0]], 3), "acceptance": round(first["acceptance"], 3),
                      "drafted": first["drafted"], "tokens_per_decode": round(first["tokens_per_decode"], 2),
                      "identical": all(x["tokens"] == runs[modes[0]][0]["tokens"] for x in runs[m])}
        row["tokens_per_decode_off"] = round(runs[modes[0]][0]["tokens_per_decode"], 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
