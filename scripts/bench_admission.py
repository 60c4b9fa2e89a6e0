#!/usr/bin/env python
"""What admitting a prompt costs as the number of slots grows (no model: the scheduler alone).

Every slot caches a finished 104-token prompt that starts with the same 64-token system prompt;
then 2,000 prompts of the same shape are admitted, scheduled and released one by one. The
prefix index makes this cost the same at 8 slots as at 256.

    python scripts/bench_admission.py --slots 8,64,256
"""

from __future__ import annotations

import argparse
import random
import time

from llamabatch import SamplingParams
from llamabatch.engine.scheduler import Scheduler
from llamabatch.engine.sequence import Sequence


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", default="8,64,256")
    parser.add_argument("--prompts", type=int, default=2000)
    args = parser.parse_args()
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(64)]

    def prompt(i: int) -> Sequence:
        tokens = system + [rng.randrange(1000) for _ in range(40)]
        return Sequence(i, "", SamplingParams(), tokens, len(tokens))

    for slots in map(int, args.slots.split(",")):
        scheduler = Scheduler(n_slots=slots, n_batch=4096)
        first = [prompt(i) for i in range(slots)]
        for seq in first:
            scheduler.add(seq)
        scheduler.admit()
        for seq in first:  # each slot keeps its finished prompt as a cached prefix
            seq.n_past = len(seq.tokens)
            scheduler.release(seq)
        started = time.perf_counter()
        for i in range(args.prompts):
            scheduler.add(prompt(i))
            [seq] = scheduler.admit()
            seq.n_past = len(seq.tokens)
            scheduler.schedule()
            scheduler.release(seq)
        each = (time.perf_counter() - started) / args.prompts
        print(f"{slots:>4} cached slots: {each * 1e6:7.1f} us to admit, schedule and release a prompt")


if __name__ == "__main__":
    main()
