"""Constrained decoding on the tiny model: whatever the (random) model prefers, every constraint
kind yields only strings it allows, sequence by sequence, beside unconstrained ones."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import numpy as np
import pytest

from llamabatch import ConstraintError, SamplingParams
from llamabatch.engine.sampling.constraints import apply_mask

from reference import reference_next_logits

PROMPTS = ["hello world", "the capital of France is", "Once upon a time", "def fib(n):"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
SAMPLED = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=96)


def run(engine, params: SamplingParams, seeds=range(6)) -> list:
    """Every prompt under every seed, all in one batch."""
    results = engine.generate([p for _ in seeds for p in PROMPTS],
                              [replace(params, seed=s) for s in seeds for _ in PROMPTS])
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    return results


def test_a_json_schema_is_always_met(make_engine):
    results = run(make_engine(n_parallel=8, n_ctx=8192), replace(SAMPLED, json_schema=SCHEMA))
    for r in results:
        assert r.finish_reason == "stop"  # the constraint completed, not cut by max_tokens
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_any_json_object(make_engine):
    results = run(make_engine(n_parallel=8, n_ctx=8192), replace(SAMPLED, json_schema={"type": "object"}, max_tokens=48), seeds=range(3))
    finished = [r for r in results if r.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(r.text), dict) for r in finished)
    assert all(r.text.startswith("{") for r in results)  # cut short by max_tokens, still a JSON object so far


def test_regex_choice_and_grammar(make_engine):
    engine = make_engine(n_parallel=8, n_ctx=4096)
    for r in run(engine, replace(SAMPLED, regex=r"[a-c]{2,5}-[0-9]{1,3}")):
        assert re.fullmatch(r"[a-c]{2,5}-[0-9]{1,3}", r.text), r.text
    choices = ("yes", "no", "not sure")
    assert {r.text for r in run(engine, replace(SAMPLED, choice=choices))} <= set(choices)
    gbnf = 'root ::= "(" digits ")"\ndigits ::= [0-9] | [0-9] digits'
    for r in run(engine, replace(SAMPLED, grammar=gbnf, max_tokens=40)):
        assert r.finish_reason == "length" or re.fullmatch(r"\(\d+\)", r.text), r.text
        assert re.fullmatch(r"\(\d*\)?", r.text)  # a prefix of the language, even when cut short


def test_constrained_and_free_sequences_in_one_batch_do_not_touch_each_other(make_engine):
    engine = make_engine(n_parallel=8, n_ctx=4096)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    choices = SamplingParams(temperature=0, max_tokens=12, choice=("the capital", "a world"))
    free_alone = engine.generate(PROMPTS, greedy)
    constrained_alone = engine.generate(PROMPTS, choices)
    mixed = engine.generate(PROMPTS * 2, [greedy] * 4 + [choices] * 4)
    assert [r.token_ids for r in mixed[:4]] == [r.token_ids for r in free_alone]
    assert [r.text for r in mixed[4:]] == [r.text for r in constrained_alone]


def test_samples_and_shared_prompts_keep_their_own_constraints(make_engine):
    engine = make_engine(n_parallel=8, n_ctx=4096)
    prompt = "the capital of France is Paris and"
    # n samples follow one leader and draw their first token from its row: each keeps its constraint
    samples = engine.generate([prompt], replace(SAMPLED, choice=("red", "green", "blue"), n=5, seed=3))
    assert {r.text for r in samples} <= {"red", "green", "blue"}
    # two requests with the same prompt and different constraints share that row, not their masks
    a, b, c = engine.generate([prompt] * 3, [replace(SAMPLED, choice=("red", "green")), replace(SAMPLED, regex="[0-9]{3}"),
                                             SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)])
    assert a.text in ("red", "green") and re.fullmatch("[0-9]{3}", b.text)
    assert c.token_ids == engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids


def test_greedy_takes_the_most_likely_allowed_token(make_engine, tiny_model):
    """The mask comes before the argmax: greedy output starts with the most likely token among
    those that begin an allowed string (here every token that spells one of the letters)."""
    engine = make_engine(n_parallel=2)
    options = ("e", "t", "a", "o", "n", "s", "x")
    prompt = engine.tokenize_prompt("Once upon a time")
    [result] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, choice=options))
    row = reference_next_logits(tiny_model, prompt)
    allowed = [t for t in range(engine.vocab.n_vocab) if engine.vocab.piece(t).decode(errors="replace") in options]
    assert len(allowed) > len(options)  # a letter is a word piece and a byte token
    assert result.text == engine.vocab.piece(max(allowed, key=lambda t: row[t])).decode()
    assert int(np.argmax(row)) not in allowed  # the unmasked favourite is not one of them: the mask decided


def test_constraints_that_cannot_compile_are_refused_with_the_reason(make_engine):
    engine = make_engine()
    with pytest.raises(ConstraintError, match="invalid regex"):
        engine.add("hi", SamplingParams(regex="a(b"))
    with pytest.raises(ConstraintError, match=r"Unimplemented keys: \[\"if\", \"then\"\]"):
        engine.add("hi", SamplingParams(json_schema={"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}))
    with pytest.raises(ConstraintError, match="Unknown format"):
        engine.add("hi", SamplingParams(json_schema={"type": "string", "format": "no-such-format"}))
    with pytest.raises(ConstraintError, match="invalid grammar"):
        engine.add("hi", SamplingParams(grammar='root ::= "unterminated'))
    [failed, fine] = engine.submit(["hi", "hello"], [SamplingParams(regex="a(b"), SamplingParams(max_tokens=2)])
    assert failed.finish_reason == "error" and "invalid regex" in failed.error and fine.finish_reason is None


def test_a_constraint_is_compiled_once_and_keeps_its_property_order(make_engine):
    engine = make_engine(n_parallel=4)
    for same in (SCHEMA, json.loads(json.dumps(SCHEMA)), json.dumps(SCHEMA, indent=2)):  # equal, however written
        results = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=96, json_schema=same))
    assert engine.grammars.compiles == 1  # twelve sequences got copies of one compiled schema
    assert all(list(json.loads(r.text)) == [k for k in SCHEMA["properties"] if k in json.loads(r.text)] for r in results)
    reordered = {**SCHEMA, "properties": dict(reversed(SCHEMA["properties"].items()))}
    [r] = engine.generate(["hi"], SamplingParams(temperature=0, max_tokens=96, json_schema=reordered))
    assert list(json.loads(r.text))[0] == "tags" or "tags" not in json.loads(r.text)  # the schema's order is the output's
    assert engine.grammars.compiles == 2


@pytest.mark.parametrize("allowed", ["three", "all but forty", "every other"])
def test_a_mask_leaves_exactly_the_allowed_logits(allowed):
    """llguidance's bitmask on a vocabulary as large as Gemma 3's (and not a whole number of
    words): a mask that allows a few tokens, one that forbids a few, and one in between (each
    applied its own way) leave the allowed logits as they were, bit for bit, and -inf elsewhere."""
    n_vocab = 262_144 - 5
    rng = np.random.default_rng(7)
    ids = {"three": rng.choice(n_vocab, 3, replace=False),
           "all but forty": np.setdiff1d(np.arange(n_vocab), rng.choice(n_vocab, 40, replace=False)),
           "every other": np.arange(0, n_vocab, 2)}[allowed]
    bits = np.zeros((n_vocab + 31) // 32 * 32, dtype=np.uint8)  # llguidance's words cover its vocabulary: padding clear
    bits[ids] = 1
    mask = np.packbits(bits, bitorder="little").view(np.int32)
    row = rng.standard_normal(n_vocab).astype(np.float32)
    expected = np.full(n_vocab, -np.inf, dtype=np.float32)
    expected[ids] = row[ids]
    apply_mask(mask, row)
    assert np.array_equal(row.view(np.uint32), expected.view(np.uint32))
