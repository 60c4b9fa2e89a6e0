"""A batch job's size and expected time, before it runs (`llamabatch batch --estimate`).

One pass over the input tokenizes every request as the job would (chat templates included) and
adds up its prompt tokens and the most tokens it may generate; the time comes from the batch
size measurement stored for this model and settings (`llamabatch tune`): prompts at its prefill
rate, generated tokens at the decode rate measured nearest the job's --parallel.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..engine import BatchEngine, SamplingParams
from ..engine.sizing.tuning import Tuning, load, settings_of
from ..errors import LlamabatchError
from ..openai_format import EngineInputs, engine_inputs
from .inputs import BadLine, RequestReader


@dataclass(frozen=True)
class JobEstimate:
    requests: int
    bad_lines: int  # lines that would go to the error file without running
    prompt_tokens: int  # each prompt once (its n samples share it)
    max_new_tokens: int  # max_tokens of every sequence, or what its context leaves
    parallel: int
    kv_bytes: int  # the KV cache the engine holds
    seconds: float | None  # None: no measurement stored for this model and settings

    def to_dict(self) -> dict:
        return {**asdict(self), "seconds": None if self.seconds is None else round(self.seconds, 3)}


def estimate(engine: BatchEngine, source: str | Path, base: SamplingParams | None, tuning: Tuning | None) -> JobEstimate:
    requests = bad = sequences = prompt_tokens = new_tokens = 0
    room = engine.ctx.n_ctx // engine.config.n_parallel  # one sequence's cells
    reader = RequestReader(source, base)
    try:
        for item in reader:
            if isinstance(item, BadLine):
                bad += 1
                continue
            if item.embedding is not None:  # runs, but generates nothing (its embedding time is not modelled)
                requests += 1
                continue
            try:
                if item.body is not None:
                    inputs = engine_inputs(item.body, engine)
                else:
                    assert item.params is not None, "a llamabatch-format line carries its sampling"
                    inputs = EngineInputs([item.engine_prompt()], item.params)
                prompts, params = inputs.prompts, inputs.params
                lengths = [engine.prompt_length(p) for p in prompts]
            except LlamabatchError:
                bad += 1  # refused when it runs, as here
                continue
            requests += 1
            sequences += params.n * len(lengths)
            prompt_tokens += sum(lengths)
            new_tokens += sum(params.n * max(0, min(params.max_tokens, room - n)) for n in lengths)
    finally:
        reader.close()
    parallel = engine.config.n_parallel
    # fewer sequences than slots decode in a smaller batch, at that batch's rate
    return JobEstimate(requests, bad, prompt_tokens, new_tokens, parallel, engine.ctx.kv_bytes,
                       expected_seconds(tuning, min(parallel, max(1, sequences)), prompt_tokens, new_tokens))


def stored_tuning(engine: BatchEngine) -> Tuning | None:
    """The batch-size measurement `llamabatch tune` stored for this engine's model and settings
    on this machine, if one was made (the server's estimates measure nothing)."""
    return load(settings_of(engine.config, engine.model.path))


def expected_seconds(tuning: Tuning | None, parallel: int, prompt_tokens: int, new_tokens: int) -> float | None:
    """Prefill at the measured prompt rate, decoding at the decode rate of the measured batch
    size nearest `parallel` (from below when there is one)."""
    if tuning is None:
        return None
    below = [p for p in tuning.points if p.batch_size <= parallel]
    point = max(below, key=lambda p: p.batch_size) if below else min(tuning.points, key=lambda p: p.batch_size)
    return prompt_tokens / point.s_pp + new_tokens / point.s_tg
