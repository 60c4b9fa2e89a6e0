"""`llamabatch verify-determinism`: is each prompt's output the same alone and in any batch?

Every prompt is generated alone (one slot), then all together at each --parallel, half of
them joining a few steps after the others (continuous batching). Token ids are compared, and
so are the sampled tokens' log-probabilities, bit for bit: a path that changes the logits'
rounding without flipping a token yet shows there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..engine import BatchEngine, SamplingParams, Sequence
from ..errors import PromptError
from ..engine.sequence import common_prefix

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
    logprobs_identical: bool  # the sampled tokens' log-probabilities, bit for bit


def verify(
    prompts: list[str], parallels: list[int], params: SamplingParams, *, deterministic: bool = True,
    ctx_per_seq: int = 1024, progress: Callable[[int, int, str], None] | None = None, **engine,
) -> list[Check]:
    """Compare each prompt's output alone against its output in batches of each size; every
    engine gives a sequence the same ctx_per_seq cells. `progress` hears the runs done of all
    (each prompt alone, then each batch size), and what the last one was."""
    say = progress or (lambda done, total, status: None)
    runs = len(prompts) + len(parallels)
    params = replace(params, logprobs=0)
    with BatchEngine(n_parallel=1, n_ctx=ctx_per_seq, deterministic=deterministic, **engine) as solo:
        lengths = [len(solo.tokenize_prompt(p)) for p in prompts]
        longest = max(range(len(prompts)), key=lengths.__getitem__)
        if lengths[longest] + params.max_tokens > ctx_per_seq:
            raise PromptError(
                f"prompt {longest + 1} is {lengths[longest]} tokens: with --max-tokens {params.max_tokens} it needs "
                f"{lengths[longest] + params.max_tokens} KV cells, more than --ctx-per-seq {ctx_per_seq}: raise --ctx-per-seq"
            )
        alone = []
        for i, prompt in enumerate(prompts):
            alone.append(_outputs(solo.submit([prompt], params), solo)[0])
            say(i + 1, runs, f"prompt {i} alone")
    checks = []
    for n, parallel in enumerate(parallels, 1):
        with BatchEngine(n_parallel=parallel, n_ctx=parallel * ctx_per_seq, deterministic=deterministic, **engine) as batch:
            together = _outputs(_staggered(batch, prompts, params), batch)
        for i, ((a, a_logprobs), (b, b_logprobs)) in enumerate(zip(alone, together)):
            checks.append(Check(i, lengths[i], parallel, a == b, _first_difference(a, b), a_logprobs == b_logprobs))
        identical = sum(c.identical for c in checks if c.parallel == parallel)
        say(len(prompts) + n, runs, f"--parallel {parallel}: {identical}/{len(prompts)} identical")
    return checks


def _outputs(sequences: list[Sequence], engine: BatchEngine) -> list[tuple[list[int], list[float]]]:
    """Run the engine dry; each sequence's generated tokens and their log-probabilities."""
    while engine.has_work:
        engine.step()
    for seq in sequences:
        if seq.error:
            raise PromptError(f"prompt {seq.prompt[:40]!r}: {seq.error}")
    return [(seq.tokens[seq.n_prompt :], [lp.logprob for lp in seq.logprobs]) for seq in sequences]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Where two token lists first differ (the shorter one's length if one extends the other)."""
    n = common_prefix(a, b)
    return None if n == len(a) == len(b) else n


def _staggered(engine: BatchEngine, prompts: list[str], params: SamplingParams) -> list[Sequence]:
    """Half the prompts start together; the rest join after a few steps, mid-run."""
    half = len(prompts) // 2
    sequences = engine.submit(prompts[:half], params)
    for _ in range(5):
        engine.step()
    return sequences + engine.submit(prompts[half:], params)


def read_prompts(path: Path | None) -> list[str]:
    if path is None:
        return DEFAULT_PROMPTS
    return [line for line in path.read_text().splitlines() if line.strip()]
