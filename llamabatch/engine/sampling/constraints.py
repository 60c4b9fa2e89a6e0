"""Constrained decoding with llguidance: a sequence whose SamplingParams carry a JSON schema, a
GBNF grammar, a regular expression or a list of choices gets a matcher, and before each of its
tokens is sampled its row of logits is masked so that only tokens the constraint allows remain.

llguidance was chosen by measurement (docs/guides/structured-output.md): on Gemma 3's 262,144-token
vocabulary a mask costs tens of microseconds and a compile about a millisecond, where
llama.cpp's grammar sampler filters the whole vocabulary on every step. Each distinct
constraint is compiled once; sequences get copies of the compiled matcher.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import llguidance
import llguidance.llamacpp
import llguidance.numpy
import numpy as np

from ...errors import ConstraintError
from .json_bounds import DigitBounds, DigitProfile, NumberLexer, bounded_formats
from ..native.handles import Vocab
from .params import SamplingParams

COMPILED_CACHE = 256  # distinct constraints kept compiled (a batch job sends one schema a million times)
# JSON without free whitespace ({"a":1}), as OpenAI's structured outputs write it: no run of
# newlines for a small model to loop on. An override, so a schema's own "x-guidance" cannot undo it.
JSON_LAYOUT = {"whitespace_flexible": False}
ALL_ONES = np.uint32(0xFFFFFFFF)
NEG_INF_BITS = np.float32(-np.inf).view(np.uint32)
# A mask whose allowed (or forbidden) tokens lie in fewer than one word in this many is applied
# through those tokens' ids (apply_mask): up to about a fifth, that is quicker than the bitwise way.
FEW_WORDS = 8


@dataclass(frozen=True)
class Constraint:
    kind: str  # "json_schema", "grammar", "regex", "lark" or "choice"
    source: str  # the schema's JSON, the GBNF, the regex, the Lark grammar, or the choices as a JSON list

    @classmethod
    def of(cls, params: SamplingParams) -> Constraint | None:
        for kind in ("json_schema", "grammar", "regex", "lark"):
            if getattr(params, kind) is not None:
                return cls(kind, getattr(params, kind))
        return cls("choice", json.dumps(list(params.choice))) if params.choice is not None else None

    def digit_bounds(self) -> DigitBounds | None:
        """How many digits a JSON output's numbers may have (None: not JSON)."""
        return DigitBounds.of_schema(self.source) if self.kind == "json_schema" else None

    def llguidance_grammar(self) -> str:
        if self.kind == "json_schema":
            schema = bounded_formats(json.loads(self.source))
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
            except ValueError as e:  # e.g. an integer past 64 bits, which llguidance cannot read
                raise ConstraintError(f"invalid JSON schema: {e}") from None
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        if self.kind == "choice":  # JSON string literals are Lark string literals too
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(self.source)))
        try:
            return llguidance.LLMatcher.grammar_from_lark(llguidance.gbnf_to_lark.gbnf_to_lark(self.source))
        except llguidance.gbnf_to_lark.GbnfToLarkError as e:
            raise ConstraintError(f"invalid grammar: {e}") from None


class Matcher:
    """One sequence's constraint: a copy of the compiled llguidance matcher, and for JSON the
    lexer that keeps its numbers within their digit bounds (json_bounds)."""

    def __init__(self, llg: llguidance.LLMatcher, bounds: DigitBounds | None, vocab: Vocab) -> None:
        self.llg, self.bounds, self._vocab = llg, bounds, vocab
        self.lexer = NumberLexer() if bounds is not None else None

    def consume_token(self, token: int) -> bool:
        """Advance past an accepted token; False (an error state) if the constraint refuses it."""
        if not self.llg.consume_token(token):
            return False
        if self.lexer is not None:
            self.lexer.feed(self._vocab.piece(token))
        return True

    def is_stopped(self) -> bool:
        return self.llg.is_stopped()

    def get_error(self) -> str:
        """llguidance's error: its first line and its stop reason (the rest is parser state)."""
        lines = self.llg.get_error().strip().splitlines()
        return "; ".join(lines[:1] + [line for line in lines[1:] if line.startswith("Stop:")])


def apply_mask(mask: np.ndarray, row: np.ndarray) -> None:
    """Set to -inf, in place, every logit of `row` whose bit is clear in `mask` (llguidance's
    bitmask: token t is bit t % 32 of word t // 32). Most masks allow a few tokens (JSON's
    punctuation, a key, an enum) or forbid a few (a string's quote, escapes and control
    characters): those few are found from the words that hold them, and only their logits are
    touched (the row filled around the allowed ones), where the bitwise way makes several passes
    over the whole row (a third of its time on a 262k vocabulary, or less)."""
    allowing = np.flatnonzero(mask)
    if len(allowing) * FEW_WORDS < len(mask):
        allowed = _set_bits(allowing, mask[allowing], len(row))
        kept = row[allowed]
        row.fill(-np.inf)
        row[allowed] = kept
        return
    refused = ~mask
    forbidding = np.flatnonzero(refused)
    if len(forbidding) * FEW_WORDS < len(mask):
        row[_set_bits(forbidding, refused[forbidding], len(row))] = -np.inf
        return
    # As many allowed as not: bitwise on the float bits, not np.putmask, which branches per
    # element and costs 1 ms on a 262k row whose mask mixes allowed and forbidden tokens; this
    # costs 0.15 ms.
    keep = np.multiply(np.unpackbits(mask.view(np.uint8), bitorder="little")[: len(row)], ALL_ONES, dtype=np.uint32)
    bits = row.view(np.uint32)
    np.bitwise_and(bits, keep, out=bits)  # allowed logits stay as they were
    np.bitwise_or(bits, NEG_INF_BITS & ~keep, out=bits)  # forbidden ones become -inf


def _set_bits(at: np.ndarray, words: np.ndarray, n_vocab: int) -> np.ndarray:
    """The token ids of the set bits of `words`, the bitmask's words at indexes `at` (ids past
    the vocabulary, the last word's padding, left out)."""
    bits = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
    ids = at[bits >> 5] * 32 + (bits & 31)
    return ids[ids < n_vocab]


class Grammars:
    """Compiles constraints against one vocabulary and hands out matchers for sequences."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self._tokenizer: llguidance.LLTokenizer | None = None  # ~2 s for a 262k vocabulary: built when first needed
        self._digits: DigitProfile | None = None  # built with the first JSON constraint
        self._compiled: OrderedDict[Constraint, tuple[llguidance.LLMatcher, DigitBounds | None]] = OrderedDict()
        self._executor = llguidance.LLExecutor()
        self._mask: np.ndarray | None = None
        self.compiles = 0  # constraints compiled (the rest were copies of a compiled one)
        self._lock = threading.Lock()  # over the tokenizer's build and the compiled cache

    def compile(self, constraint: Constraint) -> tuple[llguidance.LLMatcher, DigitBounds | None]:
        """The constraint compiled (once; later calls find it in the cache). Raises
        ConstraintError naming what cannot be compiled: an invalid grammar or regex, or a schema
        feature llguidance does not implement (never a silently unconstrained answer). Safe from
        any thread: the server compiles a request's constraint before the engine thread takes it,
        so that a large schema (or the first one's tokenizer, about 2 s) stalls no stream."""
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is None:
                bounds = constraint.digit_bounds()
                llg = llguidance.LLMatcher(self._llg_tokenizer(), constraint.llguidance_grammar(), log_level=0)
                if llg.is_error():
                    raise ConstraintError(f"invalid {constraint.kind.replace('_', ' ')}: {llg.get_error().strip()}")
                compiled = self._compiled[constraint] = (llg, bounds)
                self.compiles += 1
                while len(self._compiled) > COMPILED_CACHE:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(constraint)
            return compiled

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher for one sequence (its constraint compiled if it was not yet)."""
        llg, bounds = self.compile(constraint)
        return Matcher(llg.deep_copy(), bounds, self.vocab)

    def mask_rows(self, matchers: Seq[Matcher], rows: Seq[np.ndarray]) -> None:
        """Set to -inf, in place, every logit the matching matcher forbids (masks computed together,
        without the GIL), and for a JSON number every token past its digit bounds."""
        n_words = (self._llg_tokenizer().vocab_size + 31) // 32
        if self._mask is None or self._mask.shape[0] < len(matchers):
            self._mask = np.empty((max(len(matchers), 8), n_words), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(m.llg, i) for i, m in enumerate(matchers)], self._mask)
        for i, (matcher, row) in enumerate(zip(matchers, rows)):
            apply_mask(self._mask[i], row)
            if matcher.lexer is not None:
                self._bound_digits(matcher, row)

    def _bound_digits(self, matcher: Matcher, row: np.ndarray) -> None:
        """Inside a JSON number, also forbid the tokens that would take it past its digit bounds
        or into an exponent, unless nothing would be left (a schema whose value needs more
        digits still gets a valid answer)."""
        if self._digits is None:
            self._digits = DigitProfile([self.vocab.piece(t) for t in range(self.vocab.n_vocab)])
        banned = self._digits.banned(matcher.lexer, matcher.bounds)
        if banned is None:
            return
        kept = row[banned]
        row[banned] = -np.inf
        if not np.isfinite(row).any():  # nothing left but them: they stay
            row[banned] = kept

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        """Built under the lock by compile(), which every matcher comes from, before mask_rows needs it."""
        if self._tokenizer is None:
            vocab = self.vocab
            # Every end-of-generation token (EOS, <end_of_turn>, ...) may end a finished constraint.
            eog = vocab.eog_tokens() or None
            with warnings.catch_warnings():  # llguidance calls a deprecated llama_cpp name once per token
                warnings.simplefilter("ignore", DeprecationWarning)
                self._tokenizer = llguidance.llamacpp.lltokenizer_from_vocab(vocab.handle, eos_token=eog)
        return self._tokenizer
