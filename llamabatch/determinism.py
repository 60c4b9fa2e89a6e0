"""`llamabatch verify-determinism`: is each prompt's output the same alone and in any batch?

Every prompt is generated alone (one slot), then all together at each --parallel, half of
them joining a few steps after the others (continuous batching). Token ids are compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .engine import BatchEngine
from .errors import PromptError
from .sampling import SamplingParams
from .sequence import common_prefix

# Prompts of about 10 to 400 tokens (Gemma's tokenizer), in two styles.
_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps "
    "and listening to the sea below. Ships passed in the dark, trusting the light he kept. "
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n"
    "    return out + a + b\n"
)
_WORDS = _TEXT.split(" ")
DEFAULT_PROMPTS = [
    f"{i}. " + " ".join((_WORDS * 12)[i * 7 : i * 7 + n]) for i, n in enumerate([6, 12, 25, 50, 100, 150, 220, 300] * 2)
]


@dataclass(frozen=True)
class Check:
    index: int
    prompt_tokens: int
    parallel: int
    identical: bool
    first_difference: int | None  # position in the generated tokens, when they differ


def verify(
    prompts: list[str], parallels: list[int], params: SamplingParams, *, deterministic: bool = True,
    ctx_per_seq: int = 1024, **engine,
) -> list[Check]:
    """Compare each prompt's tokens alone against its tokens in batches of each size; every
    engine gives a sequence the same ctx_per_seq cells."""
    with BatchEngine(n_parallel=1, n_ctx=ctx_per_seq, deterministic=deterministic, **engine) as solo:
        lengths = [len(solo.tokenize_prompt(p)) for p in prompts]
        alone = [solo.generate([p], params)[0] for p in prompts]
    failed = [r for r in alone if r.error]
    if failed:
        raise PromptError(f"prompt {failed[0].index}: {failed[0].error}")
    checks = []
    for parallel in parallels:
        with BatchEngine(n_parallel=parallel, n_ctx=parallel * ctx_per_seq, deterministic=deterministic, **engine) as batch:
            together = _staggered(batch, prompts, params)
        for i, (a, b) in enumerate(zip((r.token_ids for r in alone), together)):
            checks.append(Check(i, lengths[i], parallel, a == b, _first_difference(a, b)))
    return checks


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Where two token lists first differ (the shorter one's length if one extends the other)."""
    n = common_prefix(a, b)
    return None if n == len(a) == len(b) else n


def _staggered(engine: BatchEngine, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    """Half the prompts start together; the rest join after a few steps, mid-run."""
    half = len(prompts) // 2
    sequences = engine.submit(prompts[:half], params)
    for _ in range(5):
        engine.step()
    sequences += [engine.add(p, params, index=half + i)[0] for i, p in enumerate(prompts[half:])]
    while engine.has_work:
        engine.step()
    return [seq.tokens[seq.n_prompt :] for seq in sequences]


def read_prompts(path: Path | None) -> list[str]:
    if path is None:
        return DEFAULT_PROMPTS
    return [line for line in path.read_text().splitlines() if line.strip()]
