"""LoRA adapters on real contexts with the tiny model and adapters written for it: what llama.cpp
computes under an adapter, the engine's adapter groups, the prefix cache keyed by adapter set,
bad adapters, and adapters chosen per request in the server (the official openai client) and in
job files."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from llamabatch import BatchEngine, LlamabatchError, SamplingParams
from llamabatch.engine.native.handles import Batch, Context, LoraAdapter, Model
from llamabatch.errors import ConfigError, ModelError, SamplingError, UnknownModel
from llamabatch.jobs import BatchJob

from reference import batch_seq_ids, reference_greedy
from tiny_model import write_tiny_lora, write_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["hello world", "the capital of France is", "Once upon a time", "def fib(n):"]
LONG = "Once upon a time in a land far away there lived a king who had three daughters and a dog"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return write_tiny_lora(folder / "a.gguf", seed=1), write_tiny_lora(folder / "b.gguf", seed=2)


def with_adapters(*pairs: tuple[int, float]) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, adapters=pairs)


def loaded(*paths: Path) -> list[str]:
    """--lora values that load adapters without applying them by default (scale 0)."""
    return [f"{path}:0" for path in paths]


def test_scale_zero_is_the_base_model_and_scale_one_is_not(tiny_model, adapters):
    """llama.cpp's own context, as llamabatch sets it: at scale 0 an adapter leaves the logits as
    they are (so the engine drops zero scales from a set), at scale 1 it moves them."""
    tokens = [1, 40, 41, 42, 43, 44]
    with Model(tiny_model) as model, LoraAdapter(model, adapters[0]) as adapter, Batch(64) as batch, \
            Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=2, kv_unified=True) as ctx:

        def logits(chosen: list[LoraAdapter], scales: list[float]) -> np.ndarray:
            ctx.clear()
            ctx.set_adapters(chosen, scales)
            batch.set(tokens, list(range(len(tokens))), [0] * len(tokens), [0] * (len(tokens) - 1) + [1])
            ctx.decode(batch)
            return ctx.output_logits(1, model.vocab.n_vocab)[0].copy()

        base, zero, one, base_again = logits([], []), logits([adapter], [0.0]), logits([adapter], [1.0]), logits([], [])
    np.testing.assert_allclose(zero, base, atol=1e-5)
    np.testing.assert_array_equal(base_again, base)  # unsetting restores the base model
    assert np.abs(one - base).max() > 0.5


def test_an_engine_adapter_at_scale_zero_is_the_base_model(make_engine, adapters):
    base = make_engine().generate(PROMPTS, GREEDY)
    zero = make_engine(lora=loaded(adapters[0])).generate(PROMPTS, GREEDY)
    one = make_engine(lora=[str(adapters[0])]).generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in zero] == [r.token_ids for r in base]
    assert [r.token_ids for r in one] != [r.token_ids for r in base]


def test_greedy_under_an_adapter_equals_a_reference_loop_that_sets_it(make_engine, tiny_model, adapters):
    a, b = adapters
    engine = make_engine(n_parallel=len(PROMPTS), n_batch=256, n_ubatch=256, n_ctx=2048, lora=[f"{a}:0.7"])
    tokens = [engine.tokenize_prompt(p) for p in PROMPTS]
    by_default = engine.generate(PROMPTS, GREEDY)  # the --lora set
    assert [r.token_ids for r in by_default] == reference_greedy(
        tiny_model, tokens, GREEDY.max_tokens, n_ctx=2048, n_batch=256, n_threads=2, lora=[(a, 0.7)])
    engine = make_engine(n_parallel=len(PROMPTS), n_batch=256, n_ubatch=256, n_ctx=2048, lora=loaded(a, b))
    chosen = engine.generate(PROMPTS, with_adapters((0, 0.5), (1, 1.5)))  # per request: two adapters at once
    assert [r.token_ids for r in chosen] == reference_greedy(
        tiny_model, tokens, GREEDY.max_tokens, n_ctx=2048, n_batch=256, n_threads=2, lora=[(a, 0.5), (b, 1.5)])


@pytest.mark.fresh_process
def test_a_sequence_beside_other_adapters_gives_what_it_gives_alone(tiny_model, adapters):
    """Deterministic mode, so that the batch's size cannot change a token: four adapter sets
    mixed in one engine give each prompt what it gives alone under its set."""
    sets = [(), ((0, 1.0),), ((1, 1.0),), ((0, 0.5), (1, 0.5))]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    params = [with_adapters(*sets[i % len(sets)]) for i in range(8)]
    settings = dict(n_ctx=4096, n_threads=2, deterministic=True, lora=loaded(*adapters))
    with BatchEngine(tiny_model, n_parallel=8, **settings) as engine:
        mixed = engine.generate(prompts, params)
        switches = engine.stats.adapter_switches
    with BatchEngine(tiny_model, n_parallel=1, **settings) as engine:
        alone = [engine.generate([prompt], p)[0] for prompt, p in zip(prompts, params)]
    assert [r.token_ids for r in mixed] == [r.token_ids for r in alone]
    assert len({tuple(r.token_ids) for r in mixed[:4]}) == 4  # the sets really differ
    assert switches >= 2 * len(sets)  # groups took turns: no set ran to the end alone first


def test_each_decode_carries_one_adapter_set_and_the_sets_take_turns(make_engine, adapters, monkeypatch):
    engine = make_engine(n_parallel=4, lora=loaded(*adapters))
    decoded: list[set] = []  # the adapter sets of the sequences in each llama_decode
    real = engine.ctx.decode

    def decode(batch):
        rows = set(batch_seq_ids(batch))
        decoded.append({s.adapters for s in engine.scheduler.running if s.seq_id in rows})
        return real(batch)

    monkeypatch.setattr(engine.ctx, "decode", decode)
    a, b = ((0, 1.0),), ((1, 1.0),)
    sequences = engine.submit(PROMPTS, [with_adapters(*a), with_adapters(*b)] * 2)
    list(engine.run())
    assert all(s.finish_reason == "length" for s in sequences)
    assert all(len(sets) == 1 for sets in decoded)
    order = [next(iter(sets)) for sets in decoded]
    assert order.count(a) == order.count(b) == GREEDY.max_tokens  # a prefill and 7 decodes each, two sequences a step
    assert all(x != y for x, y in zip(order, order[1:]))  # turns alternate: neither group waits for the other to end
    assert engine.stats.adapter_switches == len(order)  # the first from the base model the context starts with


def test_the_prefix_cache_never_serves_kv_of_another_adapter(make_engine, tiny_model, adapters):
    a, _ = adapters
    engine = make_engine(n_parallel=2, share_prefixes=True, lora=loaded(a))
    under_a = with_adapters((0, 1.0))
    engine.generate([LONG], GREEDY)  # its slot keeps the prefix, computed on the base model
    engine.reset_stats()
    first = engine.generate([LONG], under_a)[0]
    assert engine.stats.prompt_tokens_reused == 0
    engine.reset_stats()
    again = engine.generate([LONG], under_a)[0]
    assert engine.stats.prompt_tokens_reused > 0  # the same set does reuse it
    tokens = engine.tokenize_prompt(LONG)
    expected = reference_greedy(tiny_model, [tokens], GREEDY.max_tokens, n_ctx=2048, n_batch=512, n_threads=2, lora=[(a, 1.0)])
    assert first.token_ids == again.token_ids == expected[0]
    # submitted together, the same prompt under two sets is decoded twice, not copied across
    engine = make_engine(n_parallel=2, share_prefixes=True, lora=loaded(a))
    together = engine.generate([LONG, LONG], [GREEDY, under_a])
    assert engine.stats.prompt_tokens_reused == 0
    assert together[1].token_ids == expected[0] and together[0].token_ids != expected[0]


def test_bad_adapters_are_named(make_engine, tiny_model, tmp_path):
    with pytest.raises(ModelError, match="LoRA adapter 'missing': GGUF file not found"):
        make_engine(lora=[str(tmp_path / "missing.gguf")])
    with pytest.raises(ModelError, match="expect general.type to be 'adapter'"):
        make_engine(lora=[str(tiny_model)])
    other = write_tiny_lora(tmp_path / "other.gguf", n_embd=32, n_ff=64)  # made for another model
    with pytest.raises(ModelError, match="incorrect shape"):
        make_engine(lora=[str(other)])
    with pytest.raises(ConfigError, match="scale must be a finite number"):
        make_engine(lora=[f"{other}:nan"])


def test_bad_choices_of_adapters_fail_the_request_alone(make_engine, adapters):
    engine = make_engine(lora=loaded(adapters[0]))
    results = engine.generate(["hello", "world"], [GREEDY, with_adapters((0, 1.0))])
    with pytest.raises(SamplingError, match=r"no adapter with id 3 \(this engine has ids 0\)"):
        engine.add("hello", with_adapters((3, 1.0)))
    with pytest.raises(SamplingError, match="adapter 0 is given twice"):
        with_adapters((0, 1.0), (0, 0.5))
    with pytest.raises(UnknownModel, match="'nope' does not exist here"):
        engine.adapters.choose("nope", None, {engine.model_name})
    assert [r.finish_reason for r in results] == ["length", "length"]


@pytest.fixture(scope="module")
def catalog(tmp_path_factory, adapters) -> Path:
    """A catalog whose model declares both adapters by name (vLLM's way: each is a model)."""
    folder = tmp_path_factory.mktemp("catalog")
    write_tiny_model(folder / "tiny.gguf")
    (folder / "models.toml").write_text(
        'default = "tiny"\n[models.tiny]\npath = "tiny.gguf"\nparallel = 4\nn_ctx = 2048\n'
        f'[models.tiny.adapters]\nterse = "{adapters[0]}"\nhouse = {{ path = "{adapters[1]}", scale = 0.5 }}\n'
    )
    return folder / "models.toml"


def test_catalog_adapters_are_loaded_by_name(catalog, adapters):
    with BatchEngine("tiny", catalog=catalog, n_threads=2, lora=["house:1.5"]) as engine:
        # --lora NAME applies a declared adapter by default; ids: --lora ones first
        assert [(a.id, a.name, a.path, a.scale) for a in engine.adapters.info] == [
            (0, "house", adapters[1], 1.5), (1, "terse", adapters[0], 1.0)]
        assert engine.adapters.default == ((0, 1.5),)
        assert engine.adapters.choose("terse", None, {"tiny"}) == ((1, 1.0),)
        assert engine.adapters.choose("tiny", [(1, 0.25)], {"tiny"}) == ((1, 0.25),)
        assert engine.adapters.choose(None, None, {"tiny"}) is None  # the engine's default


@pytest.fixture(scope="module")
def server(serve, catalog) -> str:
    return serve(model="tiny", engine_extra={"catalog": catalog})


def test_the_server_serves_adapters_as_models_and_by_the_lora_field(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "terse", "house"}
    assert cards["terse"].model_extra["parent"] == "tiny" and "parent" not in cards["tiny"].model_extra
    listed = httpx.get(f"{server}/lora-adapters").json()
    assert [(a["id"], a["name"], a["scale"]) for a in listed] == [(0, "terse", 0.0), (1, "house", 0.0)]

    ask = dict(prompt="Once upon a time", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    base = client.completions.create(model="tiny", **ask)
    named = client.completions.create(model="house", **ask)
    by_id = client.completions.create(model="tiny", **{**ask, "extra_body": {"ignore_eos": True, "lora": [{"id": 1, "scale": 0.5}]}})
    assert named.model == "house" and base.model == by_id.model == "tiny"
    assert named.choices[0].text == by_id.choices[0].text != base.choices[0].text
    chat = client.chat.completions.create(model="terse", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert chat.model == "terse" and chat.choices[0].finish_reason in ("stop", "length")


def test_the_server_refuses_unknown_models_and_adapters(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="'gpt-4o' does not exist here"):
        client.completions.create(model="gpt-4o", prompt="hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="no adapter with id 5"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=2, extra_body={"lora": [{"id": 5, "scale": 1}]})
    with pytest.raises(openai.BadRequestError, match="not both"):
        client.completions.create(model="terse", prompt="hello", max_tokens=2, extra_body={"lora": [{"id": 0, "scale": 1}]})
    with pytest.raises(openai.BadRequestError, match="is a LoRA adapter"):
        client.embeddings.create(model="terse", input="hello")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="gpt-4o", input="hello")
    assert client.completions.create(model="tiny", prompt="still fine", max_tokens=2).choices[0].finish_reason == "length"


def test_job_lines_choose_adapters_as_the_server_does(server, catalog, tmp_path):
    lines = [
        {"id": "named", "prompt": "Once upon a time", "model": "house", "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        {"id": "by-id", "prompt": "Once upon a time", "lora": [{"id": 1, "scale": 0.5}], "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        {"id": "unknown", "prompt": "hello", "model": "gpt-4o"},
        {"id": "bad-id", "prompt": "hello", "lora": [{"id": 9, "scale": 1}]},
        {"id": "bad-shape", "prompt": "hello", "lora": [{"id": "x"}]},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # one slot: each line decodes alone, as each request does in the server (same kernels, same tokens)
    with BatchEngine("tiny", catalog=catalog, n_threads=2, n_parallel=1) as engine:
        summary = BatchJob(engine, source, tmp_path / "out.jsonl").run()
    done = {line["id"]: line for line in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    failed = {line["id"]: line for line in map(json.loads, (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines())}
    assert (summary.done, summary.failed) == (2, 3)
    served = httpx.post(f"{server}/v1/completions", json={"model": "house", "prompt": "Once upon a time", "max_tokens": 8,
                                                           "temperature": 0, "ignore_eos": True}).json()
    assert done["named"]["choices"][0]["text"] == done["by-id"]["choices"][0]["text"] == served["choices"][0]["text"]
    assert failed["unknown"]["error"]["code"] == "model_not_found"
    assert "'gpt-4o' does not exist here" in failed["unknown"]["error"]["message"]
    assert failed["bad-id"]["error"]["code"] == "invalid_request" and "no adapter with id 9" in failed["bad-id"]["error"]["message"]
    assert failed["bad-shape"]["error"]["code"] == "invalid_request" and "lora" in failed["bad-shape"]["error"]["message"]


def test_a_job_does_not_resume_under_other_adapters_or_cache_types(make_engine, adapters, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("hello\nworld\n")
    output = tmp_path / "out.jsonl"
    BatchJob(make_engine(lora=[str(adapters[0])]), source, output).run()
    assert BatchJob(make_engine(lora=[str(adapters[0])]), source, output).run().skipped == 2  # the same job resumes
    with pytest.raises(LlamabatchError, match="holds the results of a different job \\(adapters"):
        BatchJob(make_engine(lora=[str(adapters[1])]), source, output).run()
    with pytest.raises(LlamabatchError, match="cache_types \\['f16', 'f16'\\] -> \\['f32', 'f32'\\]"):
        BatchJob(make_engine(lora=[str(adapters[0])], cache_type_k="f32", cache_type_v="f32"), source, output).run()


# -- adapters loaded and unloaded while serving -----------------------------------------------


def test_an_adapter_loaded_while_serving_is_named_by_requests_and_unloaded_once_unused(serve, tiny_model, adapters, tmp_path):
    """vLLM's routes: load an adapter from under --lora-dir, answer with it as the engine answers
    with it loaded at start, refuse its unload while a stream uses it (409), unload it after; a new
    load of the same name gets a new id. Outside --lora-dir, or without one, loading is refused."""
    folder = adapters[0].parent
    base = serve(n_parallel=2, lora_dir=folder)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    ask = dict(prompt="Once upon a time", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(model="tiny", **ask).choices[0].text
    loaded_card = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters[1].name}).json()
    assert loaded_card["status"] == "loaded" and loaded_card["name"] == "late"
    assert {m.id for m in client.models.list().data} == {"tiny", "late"}
    with BatchEngine(tiny_model, n_parallel=1, n_threads=2, lora=[str(adapters[1])]) as reference:
        expected = reference.generate([ask["prompt"]], GREEDY)[0].text
    assert client.completions.create(model="late", **ask).choices[0].text == expected != plain

    stream = client.completions.create(model="late", prompt="hello", max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # running under the adapter
    busy = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert busy.status_code == 409 and "used by 1" in busy.json()["error"]["message"]
    stream.close()  # its client leaves: the sequence is cancelled
    deadline = time.monotonic() + 10
    while (r := httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "late"})).status_code == 409:
        assert time.monotonic() < deadline
    assert r.status_code == 200 and r.json()["status"] == "unloaded"
    assert {m.id for m in client.models.list().data} == {"tiny"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", **ask)
    again = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters[1])}).json()
    assert again["id"] > loaded_card["id"]  # never an id another adapter had
    assert client.completions.create(model="late", **ask).choices[0].text == expected

    refused = {
        "outside": httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "../../etc/passwd"}),
        "not an adapter": httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": "nothing.gguf"}),
        "taken": httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters[0].name}),
        "unknown": httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "never"}),
    }
    assert {k: r.status_code for k, r in refused.items()} == {"outside": 403, "not an adapter": 400, "taken": 400, "unknown": 404}
    off = serve(n_parallel=1)
    r = httpx.post(f"{off}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters[0])})
    assert r.status_code == 403 and "--lora-dir" in r.json()["error"]["message"]
