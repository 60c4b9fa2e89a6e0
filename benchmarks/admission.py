"""What admitting a prompt costs as the number of slots grows (no model: the scheduler alone).

Every slot caches a finished 104-token prompt that starts with the same 64-token system prompt;
then prompts of the same shape are admitted, scheduled and released one by one. The prefix index
keeps this cost flat from 8 slots to 256.
"""

from __future__ import annotations

import random
import time

from llamabatch import SamplingParams
from llamabatch.engine.scheduling.scheduler import Scheduler
from llamabatch.engine.sequence import Sequence

from .harness import Spread

SMOKE = ["--slots", "8,64", "--prompts", "50", "--rounds", "1"]


def arguments(parser) -> None:
    parser.add_argument("--slots", default="8,64,256")
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)


def admit_each(slots: int, n_prompts: int) -> float:
    """Seconds to admit, schedule and release one prompt with `slots` cached prefixes."""
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(64)]

    def prompt(i: int) -> Sequence:
        tokens = system + [rng.randrange(1000) for _ in range(40)]
        return Sequence(i, "", SamplingParams(), tokens, len(tokens))

    scheduler = Scheduler(n_slots=slots, n_batch=4096)
    first = [prompt(i) for i in range(slots)]
    for seq in first:
        scheduler.add(seq)
    scheduler.admit()
    for seq in first:  # each slot keeps its finished prompt as a cached prefix
        seq.n_past = len(seq.tokens)
        scheduler.release(seq)
    started = time.perf_counter()
    for i in range(n_prompts):
        scheduler.add(prompt(i))
        [seq] = scheduler.admit()
        seq.n_past = len(seq.tokens)
        scheduler.schedule()
        scheduler.release(seq)
    return (time.perf_counter() - started) / n_prompts


def run(args, report) -> None:
    rows = []
    for slots in map(int, args.slots.split(",")):
        spread = Spread.of([admit_each(slots, args.prompts) * 1e6 for _ in range(args.rounds)])
        rows.append([slots, spread])
        report.figure(f"us_per_prompt_{slots}_slots", spread)
    report.table("Admit, schedule and release one prompt (µs)", ["cached slots", "µs per prompt"], rows,
                 f"Median (lowest–highest) of {args.rounds} rounds of {args.prompts} prompts.")
