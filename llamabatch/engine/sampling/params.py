"""Per-sequence sampling parameters: what a request may ask of its draws, checked once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from ...chat.reasoning import ThinkingBudget
from ...errors import SamplingError
from ..adapters import adapter_set

MAX_SEED = 2**32 - 2  # 2**32 - 1 is llama.cpp's "pick a random seed"
MAX_SAMPLES = 1024
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
# repeat_penalty divides a repeated token's positive logit (and multiplies a negative one). Below 1
# it rewards repeating: below a hundredth that reward decides alone, and 1e-50 is 0 in float32 (a
# division by zero). Large ones are fine: 1e6 bans repeating.
MIN_REPEAT_PENALTY = 0.01

# llama-server's sampler names (common/sampling.cpp), the `samplers` a chain may be built from.
# "penalties" is accepted in any place: penalties always come first here (RowSampler.adjusted).
SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "typical_p", "top_p", "min_p", "xtc", "temperature", "infill")
CONSTRAINTS = ("json_schema", "grammar", "regex", "choice", "lark")  # SamplingParams' constraint fields


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1 = off
    min_p: float = 0.05  # 0 = off
    repeat_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # tokens the penalties look back over; -1 = whole context
    # Added to these tokens' logits before sampling, as OpenAI's logit_bias ({"token id": bias});
    # kept as sorted (token, bias) pairs so params stay hashable.
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    seed: int | None = None  # None = a random seed per sequence
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # keep generating past end-of-generation tokens (benchmarks)
    n: int = 1  # samples of the prompt; they share its KV, sample k uses seed + k
    logprobs: int | None = None  # report each token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (scores the prompt)
    # Constrained output, at most one: the text must match it (masked token by token before sampling).
    json_schema: str | dict | None = None  # a JSON schema ({"type": "object"}: any JSON object)
    grammar: str | None = None  # a GBNF grammar (llama.cpp's format)
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # exactly one of these strings
    lark: str | None = None  # a Lark grammar in llguidance's dialect (what tool calls are held to)
    # A reasoning model's thought is closed for it after this many tokens (thinking.ThinkingBudget)
    thinking_budget: ThinkingBudget | None = None
    # Special tokens whose text the answer shows (llama-server's preserved tokens): a chat format's
    # markers that are control tokens of the vocabulary ([TOOL_CALLS], [THINK]), which would
    # otherwise render as nothing, and the answer could not be read back
    shown_tokens: tuple[int, ...] = ()  # (a few: a tuple, which job manifests write as JSON)
    # llama.cpp's further samplers, named as llama-server names them; a row that uses one is drawn
    # by a llama.cpp chain of its own (chain.ChainSampler). Their defaults are off.
    dry_multiplier: float = 0.0  # DRY: penalise repeating a sequence the text already holds (0 = off)
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1: the whole context
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")
    xtc_probability: float = 0.0  # XTC: with this probability, drop the top choices above the threshold but the last
    xtc_threshold: float = 0.1
    mirostat: int = 0  # 1 or 2: mirostat v1 or v2 in place of the truncations
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    typical_p: float = 1.0  # 1 = off
    top_n_sigma: float = -1.0  # <= 0 = off
    dynatemp_range: float = 0.0  # dynamic temperature: temperature ± range, by entropy (0 = off)
    dynatemp_exponent: float = 1.0
    # vLLM's: no end-of-generation token before this many tokens; no text of these words
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    # Code filled in the middle (llama-server's): lines after the first indented by at least
    # n_indent (text.TextStream), and no new line begun once max_predict_s seconds have passed
    # since the first token (t_max_predict_ms: an editor's suggestion ends in time, at a line's end).
    n_indent: int = 0
    max_predict_s: float | None = None
    # An event (Event.progress) after each step that reads a chunk of the prompt (llama-server's
    # return_progress): a long prompt's stream shows it is being read.
    prompt_progress: bool = False
    # llama-server's `samplers`: the chain in this order, each with the fields above (chain.chain_for;
    # temperature applies only where it is named, as there). None: the engine's own order.
    samplers: tuple[str, ...] | None = None
    # LoRA adapters to decode under, as (adapter id, scale) pairs (llama-server's `lora` field;
    # ids absent are off). None: the engine's default, its --lora adapters.
    adapters: tuple[tuple[int, float], ...] | None = None

    def __post_init__(self) -> None:
        # Lists from JSON or the CLI become tuples, a schema its JSON text, so params stay hashable
        # and immutable. Keys keep their order: a schema's property order is the output's order.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "dry_sequence_breakers", tuple(self.dry_sequence_breakers))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.samplers is not None:
            object.__setattr__(self, "samplers", tuple(self.samplers))
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _schema_text(self.json_schema))
        if self.logit_bias is not None:
            pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
            object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)) or None)
        if self.adapters is not None:
            object.__setattr__(self, "adapters", adapter_set(self.adapters))  # raises SamplingError itself
        for problem in self._problems():
            raise SamplingError(f"invalid sampling parameter: {problem}")

    def _problems(self):
        if self.max_tokens < 0:
            yield f"max_tokens must be >= 0, got {self.max_tokens}"
        if self.temperature < 0:
            yield f"temperature must be >= 0, got {self.temperature}"
        if self.top_k < 0:
            yield f"top_k must be >= 0, got {self.top_k}"
        if not 0 < self.top_p <= 1:
            yield f"top_p must be in (0, 1], got {self.top_p}"
        if not 0 <= self.min_p <= 1:
            yield f"min_p must be in [0, 1], got {self.min_p}"
        if not self.repeat_penalty >= MIN_REPEAT_PENALTY:
            yield f"repeat_penalty must be >= {MIN_REPEAT_PENALTY:g} (1: off; below 1 rewards repeating), got {self.repeat_penalty:g}"
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                yield f"{name} must be in [-2, 2], got {getattr(self, name)}"
        if self.penalty_last_n < -1:
            yield f"penalty_last_n must be >= -1, got {self.penalty_last_n}"
        for token, bias in self.logit_bias or ():
            if token < 0:
                yield f"logit_bias: token ids are >= 0, got {token}"
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                yield f"logit_bias: a bias is in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias:g} for token {token}"
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            yield f"seed must be in [0, {MAX_SEED}], got {self.seed}"
        if not 1 <= self.n <= MAX_SAMPLES:
            yield f"n must be in [1, {MAX_SAMPLES}], got {self.n}"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                yield f"{name} must be in [0, {MAX_LOGPROBS}], got {k}"
        yield from self._chain_problems()
        if not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            yield f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}"
        if any(not (isinstance(w, str) and w) for w in self.bad_words):
            yield "bad_words must be non-empty strings"
        if self.thinking_budget is not None and self.thinking_budget.tokens < 0:
            yield f"a thinking budget must be >= 0 tokens, got {self.thinking_budget.tokens}"
        if self.n_indent < 0:
            yield f"n_indent must be >= 0, got {self.n_indent}"
        if self.max_predict_s is not None and not self.max_predict_s > 0:
            yield f"t_max_predict_ms must be > 0, got {self.max_predict_s * 1000:g}"
        if any(not s for s in self.stop):
            yield "stop strings must not be empty"
        if self.json_schema == "":
            yield "json_schema must be a JSON object (a schema), or its JSON text"
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) > 1:
            yield f"at most one constraint, got {' and '.join(given)}"
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            yield "choice must be a non-empty list of non-empty strings"
        for name in ("grammar", "regex", "lark"):
            if getattr(self, name) is not None and not (isinstance(getattr(self, name), str) and getattr(self, name)):
                yield f"{name} must be a non-empty string"

    def _chain_problems(self):
        if self.dry_multiplier < 0:
            yield f"dry_multiplier must be >= 0, got {self.dry_multiplier}"
        if self.dry_base < 1:
            yield f"dry_base must be >= 1, got {self.dry_base}"
        if self.dry_allowed_length < 1:
            yield f"dry_allowed_length must be >= 1, got {self.dry_allowed_length}"
        if self.dry_penalty_last_n < -1:
            yield f"dry_penalty_last_n must be >= -1 (-1: the whole context), got {self.dry_penalty_last_n}"
        if any(not (isinstance(b, str) and b) for b in self.dry_sequence_breakers):
            yield "dry_sequence_breakers must be non-empty strings"
        for name in ("xtc_probability", "xtc_threshold"):
            if not 0 <= getattr(self, name) <= 1:
                yield f"{name} must be in [0, 1], got {getattr(self, name)}"
        if self.mirostat not in (0, 1, 2):
            yield f"mirostat must be 0 (off), 1 or 2, got {self.mirostat}"
        if self.mirostat_tau < 0:
            yield f"mirostat_tau must be >= 0, got {self.mirostat_tau}"
        if self.mirostat_eta <= 0:
            yield f"mirostat_eta must be > 0, got {self.mirostat_eta}"
        if not 0 < self.typical_p <= 1:
            yield f"typical_p must be in (0, 1], got {self.typical_p}"
        if self.dynatemp_range < 0:
            yield f"dynatemp_range must be >= 0, got {self.dynatemp_range}"
        if self.dynatemp_exponent <= 0:
            yield f"dynatemp_exponent must be > 0, got {self.dynatemp_exponent}"
        for name in self.samplers or ():
            if name not in SAMPLERS:
                yield f"samplers: unknown sampler {name!r} (known: {', '.join(SAMPLERS)})"
        if self.samplers is not None and self.mirostat:
            yield "samplers and mirostat are two chains: give one"

    @property
    def uses_chain(self) -> bool:
        """Asks for a sampler only llama.cpp's own chain implements (chain.ChainSampler)."""
        return (self.dry_multiplier > 0 or self.xtc_probability > 0 or self.mirostat != 0 or self.typical_p < 1
                or self.top_n_sigma > 0 or self.dynatemp_range > 0 or self.samplers is not None)

    def per_sample(self) -> list[SamplingParams]:
        """One set per sample, in order: sample k draws with seed + k, so n samples differ yet reproduce."""
        if self.n == 1:
            return [self]
        return [
            replace(self, seed=None if self.seed is None else (self.seed + k) % (MAX_SEED + 1))
            for k in range(self.n)
        ]

    @property
    def verifiable(self) -> bool:
        """Sampled from the model's own distribution: speculative drafts can be verified by
        rejection sampling (penalties would make each draft's distribution depend on the drafts
        before it; a logit bias is not in the distribution drafts are verified against)."""
        return (self.temperature > 0 and not self.uses_penalties and self.logit_bias is None and not self.uses_chain
                and not self.min_tokens and not self.bad_words)

    @property
    def uses_penalties(self) -> bool:
        return (self.repeat_penalty, self.presence_penalty, self.frequency_penalty) != (1.0, 0.0, 0.0)

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the model's logits as they are (GreedySampler's case)."""
        return (self.temperature == 0 and not self.uses_penalties and self.logit_bias is None and not self.uses_chain
                and not self.min_tokens and not self.bad_words)


def _schema_text(schema: str | dict) -> str:
    """A schema as compact JSON text, whatever its layout ("" for one that is not a JSON object)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            return ""
    return json.dumps(schema, separators=(",", ":")) if isinstance(schema, dict) else ""
