"""No unbounded runs in JSON: every value a schema allows within the digit (and format length)
bounds is accepted by the compiled constraint (values drawn from the schema, serialised, fed through the engine's own mask
path), the bounded forms are refused past their bounds, and a constrained output that a model
would run on forever ends within them. An answer cut by max_tokens is counted, never passed off."""

from __future__ import annotations

import json
import random
from decimal import Decimal

import numpy as np
import pytest

from llamabatch import ConstraintError, SamplingParams
from llamabatch.engine.sampling.constraints import Constraint
from llamabatch.engine.sampling.json_bounds import DigitBounds, DigitProfile, NumberLexer, Part
from llamabatch.jobs import BatchJob


def accepts(engine, schema: dict, text: str) -> bool:
    """Whether the constraint takes `text` token by token, each token passing the mask the engine
    applies (llguidance's and the digit bounds), and ends complete."""
    matcher = engine.grammars.matcher(Constraint("json_schema", json.dumps(schema)))
    for token in tokens_of(engine, text):
        row = np.zeros(engine.vocab.n_vocab, dtype=np.float32)
        engine.grammars.mask_rows([matcher], [row])
        if not np.isfinite(row[token]) or not matcher.consume_token(token):
            return False
    return matcher.llg.is_accepting()


def tokens_of(engine, text: str) -> list[int]:
    """Tokens whose pieces are exactly `text` (a SentencePiece tokenizer prefixes a space token,
    which text in the middle of an output does not have)."""
    tokens = engine.vocab.tokenize(text, add_special=False)
    if engine.vocab.piece(tokens[0]) == b" " and not text.startswith(" "):
        tokens = tokens[1:]
    assert b"".join(engine.vocab.piece(t) for t in tokens) == text.encode()
    return tokens


# -- values drawn from schemas ------------------------------------------------------------


def draw(schema: dict, rng: random.Random):
    """A random instance of `schema` (the subset used below), numbers within 16 + 16 digits."""
    if "anyOf" in schema:
        return draw(rng.choice(schema["anyOf"]), rng)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        return {k: draw(v, rng) for k, v in schema["properties"].items()}
    if kind == "array":
        return [draw(schema["items"], rng) for _ in range(rng.randint(schema.get("minItems", 0), schema.get("maxItems", 4)))]
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "string":
        return "".join(rng.choice("abcxyz ") for _ in range(rng.randint(0, schema.get("maxLength", 8))))
    return draw_number(schema, rng)


def draw_number(schema: dict, rng: random.Random) -> Decimal:
    low, high = Decimal(str(schema.get("minimum", -10**15))), Decimal(str(schema.get("maximum", 10**15)))
    places = 0 if schema["type"] == "integer" else rng.choice([0, 1, 2, 5, 9, 16])
    if "multipleOf" in schema:
        step = Decimal(str(schema["multipleOf"]))
        return step * rng.randint(int(-(-low // step)), int(high // step))
    unit = Decimal(1).scaleb(-places)
    return low + unit * rng.randint(0, int((high - low) / unit))


def serialise(value) -> str:
    """Compact JSON, a Decimal written out in full (never in exponent form)."""
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{serialise(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(serialise(v) for v in value) + "]"
    return json.dumps(value)


SCHEMAS = {
    "any number": {"type": "number"},
    "probability": {"type": "number", "minimum": 0, "maximum": 1},
    "temperature": {"type": "number", "minimum": -50, "maximum": 60},
    "big integers": {"type": "integer", "minimum": -(10**15), "maximum": 10**16 - 1},
    "cents": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.01},
    "record": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "score": {"type": "number", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "point": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
        "ok": {"type": "boolean"}}, "required": ["name", "score", "tags", "point", "ok"], "additionalProperties": False},
    "anyOf": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "number", "minimum": 100, "maximum": 200}]},
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_value_the_schema_allows_within_the_bounds_is_accepted(make_engine, name):
    engine, schema, rng = make_engine(n_parallel=1), SCHEMAS[name], random.Random(name)
    values = [serialise(draw(schema, rng)) for _ in range(40)]
    refused = [text for text in values if not accepts(engine, schema, text)]
    assert not refused, refused[:5]


def test_the_bounded_forms_are_refused_past_their_bounds(make_engine):
    engine, number = make_engine(n_parallel=1), {"type": "number"}
    assert accepts(engine, number, "0." + "3" * 16) and not accepts(engine, number, "0." + "3" * 17)
    assert accepts(engine, number, "9" * 16) and not accepts(engine, number, "9" * 17)
    assert not accepts(engine, {"type": "integer"}, "1" * 17)
    for text in ("1e5", "1E5", "2.5e-3", "1e+2"):
        assert not accepts(engine, number, text), text  # no exponents
    three = {"type": "number", "x-fraction-digits": 3, "x-integer-digits": 2}
    assert accepts(engine, three, "12.345") and not accepts(engine, three, "12.3456") and not accepts(engine, three, "123.4")
    assert accepts(engine, {"type": "string"}, json.dumps("7" * 40))  # digits in a string are text, not a number
    # a bound never leaves a schema without an answer: past 16 zeros, a value above 0 still ends
    assert accepts(engine, {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "0." + "0" * 16 + "5")


def test_an_email_is_bounded_by_its_standards_length(make_engine):
    """llguidance's email format leaves the local part unbounded: the default model looped inside
    one until max_tokens. RFC 5321 bounds an address at 254 characters."""
    engine = make_engine(n_parallel=1)
    email = {"type": "object", "properties": {"email": {"type": "string", "format": "email"},
                                              "format": {"type": "string", "maxLength": 3}}}  # a property named "format"
    longest = "a" * 64 + "@" + ".".join(["b" * 61] * 3) + ".com"  # 254 characters, the standard's maximum
    assert len(longest) == 254
    assert accepts(engine, email, json.dumps({"email": longest, "format": "abc"}, separators=(",", ":")))
    assert not accepts(engine, email, json.dumps({"email": "a" + longest}, separators=(",", ":")))
    own = {"type": "string", "format": "email", "maxLength": 1000}  # a schema's own bound is kept
    assert accepts(engine, own, json.dumps("a" * 600 + "@b.com"))


def test_bad_digit_bounds_are_refused(make_engine):
    engine = make_engine(n_parallel=1)
    [seq] = engine.submit(["x"], SamplingParams(json_schema={"type": "number", "x-fraction-digits": 0}))
    assert seq.refused and "x-fraction-digits must be an integer >= 1" in seq.error
    with pytest.raises(ConstraintError, match="x-integer-digits"):
        DigitBounds.of_schema('{"x-integer-digits": "many"}')


def test_whitespace_stays_out_whatever_the_schema_asks(make_engine):
    engine = make_engine(n_parallel=1)
    loose = {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    assert accepts(engine, loose, '{"a":1}') and not accepts(engine, loose, '{"a": 1}')


# -- the lexer and the token profile, on a vocabulary with multi-digit tokens --------------------


def test_the_lexer_tells_numbers_from_strings():
    lexer = NumberLexer()
    for text, part, digits in [('{"a":', Part.OUTSIDE, 0), ("-12", Part.INTEGER, 2), (".5", Part.FRACTION, 1),
                               ("25,", Part.OUTSIDE, 0), ('"x\\"9', Part.STRING, 0), ('",', Part.OUTSIDE, 0),
                               ("3e", Part.EXPONENT, 0), ("+1", Part.EXPONENT, 1), ("]", Part.OUTSIDE, 0)]:
        lexer.feed(text.encode())
        assert (lexer.part, lexer.digits) == (part, digits), text


def test_the_profile_bans_what_would_overrun_a_number():
    pieces = [b"1", b"123", b"12.345", b".12", b"5e", b",", b"e", b"7,"]
    profile, bounds = DigitProfile(pieces), DigitBounds(integer=4, fraction=2)
    lexer = NumberLexer()
    lexer.feed(b"12")  # two integral digits: room for two more
    assert list(profile.banned(lexer, bounds)) == [1, 2, 4, 6]
    lexer.feed(b".3")  # one fraction digit: room for one more
    assert list(profile.banned(lexer, bounds)) == [1, 2, 4, 6]
    lexer.feed(b"4")
    assert list(profile.banned(lexer, bounds))[:2] == [0, 1]
    lexer.feed(b",")
    assert profile.banned(lexer, bounds) is None  # outside a number nothing is banned


# -- end to end --------------------------------------------------------------------------


def digit_token(engine, digit: str) -> int:
    return next(t for t in range(engine.vocab.n_vocab) if engine.vocab.piece(t) == digit.encode())


def test_a_model_pushed_to_write_digits_forever_ends_within_the_bounds(make_engine):
    """Every '5' forced by logit_bias: unbounded, the number would run to max_tokens and not parse."""
    engine = make_engine(n_parallel=2)
    five = digit_token(engine, "5")
    params = SamplingParams(temperature=0, max_tokens=200, logit_bias={five: 100}, json_schema={"type": "number"})
    [result] = engine.generate(["x"], params)
    assert (result.text, result.finish_reason) == ("5" * 16 + "." + "5" * 16, "stop")
    assert engine.stats.incomplete_structured == 0


def test_an_answer_cut_by_max_tokens_is_counted_and_can_go_to_the_error_file(make_engine, tmp_path):
    engine = make_engine(n_parallel=2)
    five = digit_token(engine, "5")
    cut = {"id": "cut", "prompt": "x", "max_tokens": 5, "logit_bias": {str(five): 100}, "json_schema": {"type": "number"}}
    whole = {"id": "whole", "prompt": "x", "max_tokens": 3, "choice": ["ab"]}
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(cut) + "\n" + json.dumps(whole) + "\n")
    kept = BatchJob(engine, source, tmp_path / "kept.jsonl").run()
    assert (kept.done, kept.failed, kept.incomplete) == (2, 0, 1)  # written as results, counted
    lines = {json.loads(line)["id"]: json.loads(line) for line in (tmp_path / "kept.jsonl").read_text().splitlines()}
    assert lines["cut"]["choices"][0]["finish_reason"] == "length" and lines["whole"]["choices"][0]["finish_reason"] == "stop"
    sent = BatchJob(engine, source, tmp_path / "sent.jsonl", incomplete_errors=True).run()
    assert (sent.done, sent.failed, sent.incomplete) == (1, 1, 1)
    error = json.loads((tmp_path / "sent.jsonl.errors.jsonl").read_text())
    assert error["id"] == "cut" and error["error"]["code"] == "incomplete_output"
    assert error["choices"][0]["text"] == "55555"  # the cut answer is kept, marked
    assert engine.stats.incomplete_structured == 2
