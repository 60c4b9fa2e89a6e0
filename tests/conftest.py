from __future__ import annotations

import os

# Deterministic mode turns off ggml's tiled K-quant matmul, which ggml reads once per process
# at the first matmul: set it before any test decodes, so deterministic engines can run in
# this process too. (A fresh `llamabatch --deterministic` process sets it itself; a test runs
# that path in a subprocess.)
os.environ.setdefault("GGML_CPU_TILED_MM", "0")

from pathlib import Path

import llama_cpp
import pytest

from llamabatch import BatchEngine

from tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_eos_model(tmp_path_factory) -> Path:
    """A tiny model whose greedy choice is always the end-of-sequence token."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-eos.gguf", always_eos=True)


@pytest.fixture
def make_engine(tiny_model):
    """Build engines on the tiny model (or another model); every one is closed after the test."""
    engines: list[BatchEngine] = []

    def make(model: Path | str | None = None, **settings) -> BatchEngine:
        settings = {"n_ctx": 2048, "n_parallel": 4, "n_threads": 2, **settings}
        engine = BatchEngine(model or tiny_model, **settings)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def decode_calls(monkeypatch) -> list[int]:
    """Return codes of every real llama_decode call made during the test."""
    codes: list[int] = []
    real = llama_cpp.llama_decode

    def counting(ctx, batch):
        codes.append(real(ctx, batch))
        return codes[-1]

    monkeypatch.setattr(llama_cpp, "llama_decode", counting)
    return codes
