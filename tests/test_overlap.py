"""Overlap (EngineConfig.overlap): the next plain step is decoded before this one's tokens are
accepted, and read at the next step. On a CPU llama_decode returns only when it is done, so
nothing is gained here, but the order is the one a GPU runs: these tests run it and compare
every token with the plain order."""

from __future__ import annotations

import pytest

from conftest import Faults
from llamabatch import SamplingParams
from llamabatch.errors import ConfigError

PROMPTS = ["The cat sat on", "Once upon a time", "In a galaxy far away", "Numbers: 1 2 3",
           "Dear diary,", "The recipe calls for", "Breaking news:"]


def stops_from(texts: list[str]) -> list[tuple[str, ...]]:
    """A stop string for every other text, taken from its middle: those sequences end on it."""
    stops = []
    for k, text in enumerate(texts):
        middle = next((text[i : i + 3] for i in range(len(text) // 3, len(text) - 3) if text.find(text[i : i + 3]) == i), None)
        stops.append((middle,) if k % 2 == 0 and middle else ())
    return stops


def outputs(engine, params: list[SamplingParams]) -> list[tuple]:
    return [(r.token_ids, r.text, r.finish_reason) for r in engine.generate(PROMPTS, params)]


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_overlapped_steps_give_the_plain_orders_tokens(make_engine, temperature):
    """Seven prompts through four slots (sequences join and leave mid-flight), several ending on
    stop strings (found only once their text is read, after the next step was decoded ahead):
    every token, text and finish reason as in the plain order, with steps decoded ahead."""
    base = [SamplingParams(temperature=temperature, seed=k, max_tokens=12 + 5 * k, ignore_eos=True) for k in range(len(PROMPTS))]
    plain = make_engine(overlap="off")
    free = [r.text for r in plain.generate(PROMPTS, base)]
    params = [SamplingParams(**{**p.__dict__, "stop": stop}) for p, stop in zip(base, stops_from(free))]
    expected = outputs(plain, params)
    assert sum(reason == "stop" for _, _, reason in expected) >= 2  # stop strings did end sequences
    assert plain.stats.decodes_ahead == 0

    ahead = make_engine(overlap="on")
    assert outputs(ahead, params) == expected
    assert ahead.stats.decodes_ahead > 0


def test_a_row_that_ends_on_a_stop_string_keeps_no_token_past_its_end(make_engine):
    """The token decoded ahead for a sequence that then ends on a stop string is cut off: each
    slot's memory holds exactly the tokens it keeps as a cached prefix."""
    engine = make_engine(overlap="on")
    base = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True) for _ in PROMPTS[:4]]
    free = [r.text for r in engine.generate(PROMPTS[:4], base)]
    params = [SamplingParams(**{**p.__dict__, "stop": (text[12:15],)}) for p, text in zip(base, free)]
    results = engine.generate(PROMPTS[:4], params)
    assert all(r.finish_reason == "stop" for r in results)
    assert engine.stats.decodes_ahead > 0
    for seq_id in range(4):
        slot = engine.scheduler.slots.free_slot(seq_id)
        assert engine.memory.held(seq_id) == len(slot.cached)


def test_an_ahead_decode_that_finds_the_cache_full_is_decoded_again_in_the_plain_order(make_engine, monkeypatch):
    """llama_decode answering 1 (no KV slot) for a step decoded ahead: that step is composed and
    decoded again the plain way, and every sequence ends as it would have."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = outputs(make_engine(overlap="off"), [params] * len(PROMPTS))
    engine = make_engine(overlap="on")
    Faults(monkeypatch, code=1, times=1, after=6)  # after the prompts' step and a few decodes
    assert outputs(engine, [params] * len(PROMPTS)) == expected
    assert engine.stats.decodes_ahead > 0


def test_memory_that_cannot_be_cut_keeps_the_plain_order(make_engine, family):
    """Recurrent and hybrid memory cannot lose the token decoded past a stop string (without a
    checkpoint each step): overlap on leaves them the plain order, and they still generate."""
    name, path = family
    engine = make_engine(path, overlap="on")
    assert not engine.stepper.runs_ahead
    results = engine.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [r.completion_tokens for r in results] == [8, 8, 8]
    assert engine.stats.decodes_ahead == 0


def test_auto_overlaps_only_where_layers_are_on_a_gpu(make_engine, monkeypatch):
    """On this CPU, llama_decode returns when it is done: auto keeps the plain order; on does
    not change deterministic mode's."""
    assert not make_engine(overlap="auto").stepper.runs_ahead
    assert make_engine(overlap="on").stepper.runs_ahead
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")  # (this process has decoded: deterministic mode asks for it)
    assert not make_engine(overlap="on", deterministic=True, n_ctx=4096).stepper.runs_ahead


def test_an_unknown_overlap_is_refused(make_engine):
    with pytest.raises(ConfigError, match="--overlap must be 'auto', 'on' or 'off'"):
        make_engine(overlap="sometimes")


@pytest.mark.parametrize("settings", [{}, {"speculative": "ngram"}], ids=["plain", "ngram drafts"])
def test_constrained_rows_beside_free_ones_and_drafts_give_the_plain_orders_tokens(make_engine, settings):
    """A step with a constrained row (a regex) is special and never decoded ahead, the free rows'
    steps after it may be; speculation keeps the plain order: with overlap on, every output is
    the plain order's."""
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, regex="[a-z]{1,6}( [a-z]{1,6}){0,8}") if k % 3 == 0
              else SamplingParams(temperature=0, max_tokens=10 + 3 * k, ignore_eos=True) for k in range(len(PROMPTS))]
    expected = outputs(make_engine(overlap="off", **settings), params)
    engine = make_engine(overlap="on", **settings)
    assert outputs(engine, params) == expected
    assert (engine.stats.decodes_ahead > 0) == (not settings)


@pytest.mark.real_model
def test_sliding_window_memory_past_its_window_is_cut_past_a_stop_string(make_engine):
    """The default model, Gemma 3, attends within 512 positions in most layers: four streams past
    that window, ending on stop strings, with steps decoded ahead: the token decoded past each
    stop is cut from its memory there too, which then holds exactly the slot's cached prefix."""
    engine = make_engine("gemma3-270m", overlap="on", n_ctx=4096, n_ubatch=64)
    assert engine.memory.caps.n_swa == 512 and engine.stepper.runs_ahead
    prompts = [p + " The tide came in and went out again." * 60 for p in PROMPTS[:4]]
    base = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True) for _ in prompts]
    free = engine.generate(prompts, base)
    assert all(r.prompt_tokens > 512 for r in free)
    params = [SamplingParams(**{**p.__dict__, "stop": (r.text[12:15],)}) for p, r in zip(base, free)]
    engine.reset_stats()
    results = engine.generate(prompts, params)
    assert all(r.finish_reason == "stop" for r in results)
    assert engine.stats.decodes_ahead > 0
    for seq_id in range(4):
        slot = engine.scheduler.slots.free_slot(seq_id)
        assert engine.memory.held(seq_id) == len(slot.cached)
