"""Native handles: every model, context and batch is freed exactly once by close(); sampled
sequences draw in numpy and hold no native sampler."""

from __future__ import annotations

import llama_cpp
import pytest

from llamabatch import BatchEngine, ConfigError, ModelError, SamplingParams
from llamabatch.engine.native.handles import Model

PAIRS = {
    "model": ("llama_model_load_from_file", "llama_model_free"),
    "context": ("llama_init_from_model", "llama_free"),
    "batch": ("llama_batch_init", "llama_batch_free"),
    "sampler chain": ("llama_sampler_chain_init", "llama_sampler_free"),
}


@pytest.fixture
def handles(monkeypatch) -> dict[str, list[int]]:
    """Count creations and frees of each kind, passing every call through to llama.cpp."""
    counts = {f"{kind} {what}": [0] for kind in PAIRS for what in ("created", "freed")}

    def spy(name: str, key: str):
        real = getattr(llama_cpp, name)

        def call(*args):
            counts[key][0] += 1
            return real(*args)

        monkeypatch.setattr(llama_cpp, name, call)

    for kind, (create, free) in PAIRS.items():
        spy(create, f"{kind} created")
        spy(free, f"{kind} freed")
    return counts


def balance(counts) -> dict[str, tuple[int, int]]:
    return {kind: (counts[f"{kind} created"][0], counts[f"{kind} freed"][0]) for kind in PAIRS}


def test_close_frees_everything_even_mid_run(handles, tiny_model):
    engine = BatchEngine(tiny_model, n_parallel=2, n_ctx=1024)
    engine.submit(["a", "b", "c", "d", "e"], SamplingParams(max_tokens=50))
    engine.step()
    engine.step()  # two running, three still queued, each with its sampler
    engine.close()
    engine.close()  # idempotent
    counts = balance(handles)
    assert counts["model"] == counts["context"] == counts["batch"] == (1, 1)
    assert counts["sampler chain"] == (0, 0)  # penalties, bias and truncation included (engine.truncation)


def test_the_context_lives_until_the_engine_closes(handles, tiny_model):
    with BatchEngine(tiny_model, n_parallel=2, n_ctx=1024) as engine:
        engine.generate(["a", "b", "c"], SamplingParams(max_tokens=3, repeat_penalty=1.2, logit_bias={5: 1.0}))
        assert balance(handles)["context"] == (1, 0) and balance(handles)["sampler chain"] == (0, 0)
    assert balance(handles)["context"] == (1, 1)


def test_failed_context_creation_frees_the_model(handles, tiny_model, monkeypatch):
    monkeypatch.setattr(llama_cpp, "llama_init_from_model", lambda *args: None)
    with pytest.raises(ConfigError, match="could not create a context"):
        BatchEngine(tiny_model, n_parallel=2, n_ctx=1024)
    assert balance(handles)["model"] == (1, 1)


def test_bad_settings_fail_before_loading_anything(handles, tiny_model):
    with pytest.raises(ConfigError, match="--parallel 64 leaves 16 KV cells per sequence"):
        BatchEngine(tiny_model, n_parallel=64, n_ctx=1024, kv_unified=False)
    with pytest.raises(ConfigError, match="exceeds llama.cpp's limit"):
        BatchEngine(tiny_model, n_parallel=1000, n_ctx=1 << 20)
    assert balance(handles)["model"] == (0, 0)


def test_corrupt_gguf_is_a_model_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(ModelError, match="could not load"):
        Model(bad)


def test_tokenize_and_detokenize_round_trip(tiny_model):
    with Model(tiny_model) as model:
        text = "the capital of France is Paris, héllo 世界"
        tokens = model.vocab.tokenize(text, add_special=False)
        assert model.vocab.detokenize(tokens).strip() == text
        assert model.vocab.tokenize(text)[0] == 1  # BOS added by default
        assert model.n_params > 0 and model.n_ctx_train == 2048
