"""Per-sequence sampling parameters, and the samplers that draw with them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import SamplingError
from .adapters import adapter_set
from .native import Vocab
from .results import PromptScore, TokenLogprob
from ..chat.reasoning import ThinkingBudget
from .truncation import Scratch, draw

MAX_SEED = 2**32 - 2  # 2**32 - 1 is llama.cpp's "pick a random seed"
MAX_SAMPLES = 1024
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it

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
        if self.repeat_penalty <= 0:
            yield f"repeat_penalty must be > 0, got {self.repeat_penalty}"
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
        if self.thinking_budget is not None and self.thinking_budget.tokens < 1:
            yield f"a thinking budget must be >= 1 token, got {self.thinking_budget.tokens}"
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

    @property
    def uses_chain(self) -> bool:
        """Asks for a sampler only llama.cpp's own chain implements (chain.ChainSampler)."""
        return (self.dry_multiplier > 0 or self.xtc_probability > 0 or self.mirostat != 0 or self.typical_p < 1
                or self.top_n_sigma > 0 or self.dynatemp_range > 0)

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


class GreedySampler:
    """Greedy sampling without penalties, done by the engine: one argmax over every such row of
    a step's logits. Same choice as llama.cpp's greedy sampler (the first highest logit)."""

    greedy = True

    def close(self) -> None:
        pass  # owns nothing native


class RowSampler:
    """Every other sequence's draw, from its row of a step's logits: llama.cpp's sampler chain in
    llama.cpp's order (logit bias, penalties over the last penalty_last_n tokens, prompt included,
    then top-k, top-p, min-p, temperature and a seeded draw), with the truncation found without a
    sort of the vocabulary (truncation.py). Its own generator draws, so a seed reproduces the same
    tokens whatever else is in the batch; they are not the tokens llama.cpp's generator draws."""

    greedy = False

    def __init__(self, params: SamplingParams, n_ctx: int, vocab: Vocab | None = None, n_prompt: int = 0) -> None:
        """`vocab` (for min_tokens and bad words) and `n_prompt` (where min_tokens counts from)."""
        self.params = params
        self.rng = np.random.default_rng(params.seed)  # None: fresh entropy
        bias = params.logit_bias or ()
        self.bias_ids = np.array([t for t, _ in bias], dtype=np.int64)
        self.bias_values = np.array([b for _, b in bias], dtype=np.float32)
        self.last_n = n_ctx if params.penalty_last_n == -1 else params.penalty_last_n
        self.penalised = params.uses_penalties and self.last_n > 0
        # min_tokens: the end-of-generation tokens are banned until the sequence has that many
        self.eog_ids = np.array(vocab.eog_ids if params.min_tokens else [], dtype=np.int64)
        self.until = n_prompt + params.min_tokens
        # bad words, as token sequences, with and without a space before (vLLM's bad_words)
        self.bad = sorted({tuple(vocab.tokenize(w, add_special=False)) for word in params.bad_words for w in (word, " " + word)} - {()})
        self.adjusts = bool(len(self.bias_ids) or self.penalised or self.bad or len(self.eog_ids))

    def sample(self, logits: np.ndarray, tokens: list[int], scratch: Scratch) -> int:
        """The next token after `tokens` (the prompt and what was generated) from this row."""
        if self.adjusts:
            logits = self.adjusted(logits, tokens, scratch.row)
        if self.params.temperature == 0:  # greedy after the bias and penalties
            return int(logits.argmax())
        return draw(logits, self.params, self.rng.random(), scratch)

    def adjusted(self, logits: np.ndarray, tokens: list[int], out: np.ndarray) -> np.ndarray:
        """The row with the bias, penalties, min_tokens and bad words, in `out` (the row itself
        when none applies): the step's row stays as it was (log-probabilities are reported from
        it, and followers may sample from it too)."""
        if not (len(self.bias_ids) or self.penalised or self.bad or (len(self.eog_ids) and len(tokens) < self.until)):
            return logits
        np.copyto(out, logits)
        out[self.bias_ids] += self.bias_values  # the ids are distinct (params keep one bias a token)
        if self.penalised:
            seen, counts = np.unique(np.asarray(tokens[-self.last_n :], dtype=np.int64), return_counts=True)
            p = self.params
            values = out[seen]
            values = np.where(values <= 0, values * p.repeat_penalty, values / p.repeat_penalty)
            out[seen] = values - (counts * p.frequency_penalty + p.presence_penalty).astype(np.float32)
        if len(self.eog_ids) and len(tokens) < self.until:
            out[self.eog_ids] = -np.inf
        for word in self.bad:  # its last token, where the text so far ends with the rest of it
            if len(word) == 1 or tuple(tokens[len(tokens) - len(word) + 1:]) == word[:-1]:
                out[word[-1]] = -np.inf
        return out

    def close(self) -> None:
        pass  # owns nothing native


def token_logprob(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """The token's log-probability under softmax(logits), and the k most likely tokens'."""
    peak = float(logits.max())
    log_total = peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))
    top = np.argpartition(-logits, k)[:k] if k else np.empty(0, dtype=np.int64)
    top = top[np.argsort(-logits[top])]
    rank = 1 + int((logits > logits[token]).sum())
    return TokenLogprob(token, float(logits[token]) - log_total, tuple((int(t), float(logits[t]) - log_total) for t in top), rank)


# Scored rows are worked through this many bytes of logits at a time: float64 temporaries of a
# 262k-token vocabulary would otherwise take gigabytes for a long chunk.
SCORE_PASS_BYTES = 16 << 20


def score_rows(score: PromptScore, logits: np.ndarray, targets: list[int], k: int | None) -> None:
    """Add to `score` the log-probability of each target token under its row of logits (row i
    predicts targets[i]), computed as token_logprob does; with k, keep each token and its k
    most likely alternatives too."""
    n_rows, n_vocab = logits.shape
    per_pass = max(1, SCORE_PASS_BYTES // (4 * n_vocab))
    wanted = np.asarray(targets)
    for a in range(0, n_rows, per_pass):
        rows, want = logits[a : a + per_pass], wanted[a : a + per_pass]
        peak = rows.max(axis=1)
        log_total = peak + np.log(np.exp(rows - peak[:, None], dtype=np.float64).sum(axis=1))
        chosen = rows[np.arange(len(want)), want]
        score.logprob += float((chosen - log_total).sum())
        score.n_tokens += len(want)
        score.greedy = score.greedy and bool((chosen >= peak).all())  # a tie counts as greedy
        if k is not None:
            score.tokens += [token_logprob(row, int(t), k) for row, t in zip(rows, want)]
