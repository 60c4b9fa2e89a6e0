"""No unbounded runs in JSON output. llguidance compiles a schema's numbers to unbounded digit
runs (`[0-9]*` after the point, `[eE]` exponents) and its `email` format to an unbounded local
part; a small model at a non-zero temperature can write `0.500000000000000686...` or a looping
address until max_tokens cuts the answer into something that does not parse.

Numbers are bounded as llama.cpp's own JSON-schema converter bounds them (at most 16 integral and
16 fraction digits, no exponent), beside llguidance's mask: each constrained JSON sequence keeps
a `NumberLexer` of its output (in a string? in a number's integral or fraction part, with how
many digits?), and a token that would carry a number past its bounds, or start an exponent, is
masked out too. The bounds are per constraint: a schema's top-level "x-integer-digits" /
"x-fraction-digits" (as llguidance reads "x-guidance"). Strings of a format whose standard
bounds its length get that bound as a maxLength. Every value within the bounds is accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

import numpy as np

from ...errors import ConstraintError

_DIGITS = frozenset(b"0123456789")
_EXPONENT = frozenset(b"eE")
BANNED_KEPT = 128  # sets of banned ids a profile keeps (a few places in a number, times the bounds in use)


# Formats whose standard bounds their length: RFC 5321 (an address in a 256-octet path, its angle
# brackets aside) and RFC 1035 (a name of 253 characters in text form).
FORMAT_MAX_LENGTH = {"email": 254, "hostname": 253}


def bounded_formats(node):
    """A schema (or any part of one) with a maxLength on every string whose format's standard
    bounds it, where the schema gives none."""
    if isinstance(node, list):
        return [bounded_formats(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: bounded_formats(v) for k, v in node.items()}
    limit = FORMAT_MAX_LENGTH.get(node["format"]) if isinstance(node.get("format"), str) else None
    if limit is not None and "maxLength" not in node:
        node["maxLength"] = limit
    return node


@dataclass(frozen=True)
class DigitBounds:
    integer: int = 16  # digits before a number's decimal point (llama.cpp's converter: up to 16)
    fraction: int = 16  # digits after it (llama.cpp's converter: 1 to 16)

    @classmethod
    def of_schema(cls, schema_text: str) -> DigitBounds:
        """The bounds a JSON schema asks for ("x-integer-digits", "x-fraction-digits"), else the defaults."""
        schema = json.loads(schema_text)
        given = {"integer": schema.get("x-integer-digits", cls.integer), "fraction": schema.get("x-fraction-digits", cls.fraction)}
        for name, value in given.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConstraintError(f"x-{name}-digits must be an integer >= 1, got {value!r}")
        return cls(**given)


class Part(Enum):
    OUTSIDE = 0  # between JSON tokens
    STRING = 1
    ESCAPE = 2  # just after a backslash in a string
    INTEGER = 3  # a number's digits before the point
    FRACTION = 4  # after it
    EXPONENT = 5


class NumberLexer:
    """Where a JSON text stands, fed its bytes as tokens are accepted: just enough of a JSON
    lexer to tell a number's digits from a string's."""

    def __init__(self) -> None:
        self.part = Part.OUTSIDE
        self.digits = 0  # in the current number part

    def feed(self, data: bytes) -> None:
        for byte in data:
            self._step(byte)

    def _step(self, byte: int) -> None:
        part = self.part
        if part is Part.STRING:
            self.part = Part.ESCAPE if byte == 0x5C else Part.OUTSIDE if byte == 0x22 else Part.STRING
        elif part is Part.ESCAPE:
            self.part = Part.STRING
        elif part is Part.OUTSIDE:
            if byte == 0x22:
                self.part = Part.STRING
            elif byte in _DIGITS or byte == 0x2D:  # a digit or '-': a number starts
                self.part, self.digits = Part.INTEGER, int(byte in _DIGITS)
        elif byte in _DIGITS:
            self.digits += 1
        elif part is Part.INTEGER and byte == 0x2E:
            self.part, self.digits = Part.FRACTION, 0
        elif part is not Part.EXPONENT and byte in _EXPONENT:
            self.part, self.digits = Part.EXPONENT, 0
        elif part is Part.EXPONENT and byte in (0x2B, 0x2D):  # its sign
            pass
        else:  # the number ended: this byte is the next token's
            self.part, self.digits = Part.OUTSIDE, 0
            self._step(byte)


class DigitProfile:
    """For every token of a vocabulary, what it would add to a number it continues: its
    leading digits, the digits after a point that follows them, and whether an exponent follows."""

    def __init__(self, pieces: list[bytes]) -> None:
        n = len(pieces)
        self.lead = np.zeros(n, dtype=np.int32)
        self.fraction = np.full(n, -1, dtype=np.int32)  # -1: no point after the leading digits
        self.exponent = np.zeros(n, dtype=bool)
        for token, piece in enumerate(pieces):
            lead = _run_of_digits(piece, 0)
            after = lead
            if piece[lead : lead + 1] == b".":
                self.fraction[token] = _run_of_digits(piece, lead + 1)
                after = lead + 1 + self.fraction[token]
            self.lead[token] = lead
            self.exponent[token] = piece[after : after + 1] in (b"e", b"E")
        self._banned: dict[tuple[Part, int, DigitBounds], np.ndarray] = {}  # banned()'s ids, by where the number stands

    def banned(self, lexer: NumberLexer, bounds: DigitBounds) -> np.ndarray | None:
        """The ids of the tokens that would carry the number the lexer is in past `bounds` or
        into an exponent (None outside a number, where nothing is banned). Kept for each place a
        number can stand in: a row inside one would otherwise build them from the whole vocabulary."""
        if lexer.part not in (Part.INTEGER, Part.FRACTION, Part.EXPONENT):
            return None
        key = (lexer.part, lexer.digits, bounds)
        ids = self._banned.get(key)
        if ids is None:
            if len(self._banned) >= BANNED_KEPT:
                self._banned.clear()
            ids = self._banned[key] = np.flatnonzero(self._bans(lexer.part, lexer.digits, bounds)).astype(np.int32)
        return ids

    def _bans(self, part: Part, digits: int, bounds: DigitBounds) -> np.ndarray:
        if part is Part.INTEGER:
            return (digits + self.lead > bounds.integer) | (self.fraction > bounds.fraction) | self.exponent
        if part is Part.FRACTION:
            return (digits + self.lead > bounds.fraction) | self.exponent
        return digits + self.lead > 3  # an exponent, reached within one token: kept to what a double has


def _run_of_digits(piece: bytes, start: int) -> int:
    end = start
    while end < len(piece) and piece[end] in _DIGITS:
        end += 1
    return end - start
