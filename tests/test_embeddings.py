"""Embeddings and reranking on real llama.cpp contexts: the engine, /v1/embeddings and /v1/rerank
with the official openai client, embedding lines in batch jobs, and `llamabatch embed` with its
outputs, resume and a kill."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest

from llamabatch import BatchEngine
from llamabatch.errors import ConfigError, PromptError
from llamabatch.jobs.vectors import ParquetParts, write_npy
from tiny_model import BOS, write_tiny_model

TEXTS = ["the capital of France", "hello world", "def fib(n):", "Paris is the capital", "Once upon a time", "the"]


@pytest.fixture(scope="module")
def engine(tiny_model):
    with BatchEngine(tiny_model, n_parallel=2, n_ctx=512, n_threads=2) as engine:
        yield engine


@pytest.fixture(scope="module")
def rank_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-rank.gguf", rank_head=True)


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llamabatch.cli", *args], capture_output=True, text=True, timeout=timeout)


# -- the engine ---------------------------------------------------------------------------


def test_texts_embedded_together_equal_each_embedded_alone(engine):
    together = engine.embed(TEXTS)
    alone = np.stack([engine.embed([text])[0] for text in TEXTS])
    assert together.shape == (len(TEXTS), 64)
    np.testing.assert_allclose(together, alone, atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    assert engine.embedder().decodes >= 1 and len({tuple(v.round(4)) for v in together}) == len(TEXTS)


def test_dimensions_keep_the_first_ones_renormalised(engine):
    raw = engine.embed(TEXTS[:2], normalize=False)
    cut = engine.embed(TEXTS[:2], dimensions=8)
    expected = raw[:, :8] / np.linalg.norm(raw[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-5)
    with pytest.raises(PromptError, match="dimensions must be between 1 and the model's 64"):
        engine.embed(TEXTS[:1], dimensions=65)


def test_each_pooling_pools_what_it_names(engine):
    """A causal model: the first token (cls) is BOS's vector whatever follows; one token's mean is
    that token's vector; the last token of [BOS] is BOS's too. Mean and last differ for longer texts."""
    cls = engine.embed(TEXTS[:3], pooling="cls")
    np.testing.assert_allclose(cls, np.repeat(cls[:1], 3, axis=0), atol=1e-5)
    bos_mean = engine.embed([[BOS]], pooling="mean")
    bos_last = engine.embed([[BOS]], pooling="last")
    np.testing.assert_allclose(bos_mean[0], cls[0], atol=1e-5)
    np.testing.assert_allclose(bos_last[0], cls[0], atol=1e-5)
    mean, last = engine.embed(TEXTS[:1], pooling="mean"), engine.embed(TEXTS[:1], pooling="last")
    assert np.abs(mean - last).max() > 1e-2


def test_pooling_none_gives_each_token_the_vector_the_poolings_are_made_of(engine, tiny_model, tmp_path):
    matrices = engine.token_embeddings(TEXTS[:3], normalize=False)
    assert [m.shape for m in matrices] == [(len(engine.vocab.tokenize(t)), 64) for t in TEXTS[:3]]
    np.testing.assert_allclose([m.mean(axis=0) for m in matrices], engine.embed(TEXTS[:3], pooling="mean", normalize=False), atol=1e-4)
    np.testing.assert_allclose([m[-1] for m in matrices], engine.embed(TEXTS[:3], pooling="last", normalize=False), atol=1e-4)
    with pytest.raises(ConfigError, match="use token_embeddings"):
        engine.embed(TEXTS[:1], pooling="none")
    source = tmp_path / "texts.txt"
    source.write_text("\n".join(TEXTS[:3]) + "\n")
    done = run_cli("embed", str(source), "-o", str(tmp_path / "out.jsonl"), "-m", str(tiny_model), "--pooling", "none")
    assert done.returncode == 0, done.stderr
    rows = [np.array(json.loads(line)["embedding"]) for line in (tmp_path / "out.jsonl").open()]
    assert sorted(r.shape[0] for r in rows) == sorted(m.shape[0] for m in matrices)
    np.testing.assert_allclose(np.linalg.norm(rows[0], axis=1), 1.0, atol=1e-5)  # each token's vector, unit length
    refused = run_cli("embed", str(source), "-o", str(tmp_path / "out.npy"), "-m", str(tiny_model), "--pooling", "none")
    assert refused.returncode == 1 and "a vector per token, not a row per line: write .jsonl" in refused.stderr


def test_pack_size_and_deterministic_mode_change_decodes_not_vectors(tiny_model, engine):
    before = engine.embedder().decodes
    expected = engine.embed(TEXTS)
    assert engine.embedder().decodes == before + 1  # 256 tokens a decode: all six texts
    with BatchEngine(tiny_model, n_parallel=1, n_ctx=256, n_threads=2, embed_pack=8) as small_packs:
        np.testing.assert_allclose(small_packs.embed(TEXTS), expected, atol=1e-4)
        assert small_packs.embedder().decodes >= 4  # 8 tokens a decode: a text or two each
    # Deterministic: each text decodes alone, so its vector cannot depend on what it was sent with.
    # (A process of its own: deterministic mode sets ggml's kernels before anything decodes.)
    script = (
        "import json, sys; from llamabatch import BatchEngine\n"
        f"with BatchEngine({str(tiny_model)!r}, n_parallel=1, n_ctx=512, n_threads=2, deterministic=True) as e:\n"
        f"    together = e.embed({TEXTS!r}); decodes = e.embedder().decodes\n"
        f"    alone = e.embed([{TEXTS[2]!r}])[0]\n"
        "    print(json.dumps([together.tolist(), decodes, alone.tolist()]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    together, decodes, alone = json.loads(done.stdout.splitlines()[-1])
    assert decodes == len(TEXTS) and together[2] == alone
    np.testing.assert_allclose(together, expected, atol=1e-4)
    with pytest.raises(ConfigError, match="--embed-pack must be >= 1"):
        BatchEngine(tiny_model, n_parallel=1, n_ctx=256, embed_pack=0)


def test_bad_inputs_are_refused_by_name(engine, tiny_model):
    with pytest.raises(PromptError, match="empty input"):
        engine.embed(["fine", ""])
    long_text = "e t " * 1500  # > 2048 tokens, the most an embedding takes here
    with pytest.raises(PromptError, match="longer than the 2048 an embedding takes"):
        engine.embed([long_text])
    assert engine.embed([long_text], truncate=True).shape == (1, 64)
    with pytest.raises(PromptError, match="outside the vocabulary"):
        engine.embed([[10**6]])
    with pytest.raises(ConfigError, match="no rank head"):
        engine.rerank("q", ["d"])


def test_a_reranker_scores_pairs_and_does_not_embed(rank_model):
    with BatchEngine(rank_model, n_parallel=1, n_ctx=256, n_threads=2) as reranker:
        scores = reranker.rerank("the capital of France", TEXTS)
        alone = [reranker.rerank("the capital of France", [doc])[0] for doc in TEXTS]
        assert scores.shape == (len(TEXTS),) and ((scores >= 0) & (scores <= 1)).all()  # Qwen3: softmax over yes/no
        np.testing.assert_allclose(scores, alone, atol=1e-3)
        assert len(set(scores.round(4))) > 1
        with pytest.raises(ConfigError, match="is a reranker"):
            reranker.embed(["x"])


# -- the server ---------------------------------------------------------------------------


def test_openai_client_embeddings_float_and_base64(serve, engine, client):
    expected = engine.embed(TEXTS)
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    np.testing.assert_allclose(np.array([d.embedding for d in floats.data]), expected, atol=1e-4)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    # The client's own default asks for base64 and decodes it: the same vectors.
    decoded = client.embeddings.create(model="tiny", input=TEXTS)
    np.testing.assert_allclose(np.array([d.embedding for d in decoded.data]), expected, atol=1e-4)
    raw = client.embeddings.create(model="tiny", input="hello world", encoding_format="base64", dimensions=16)
    vector = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    assert vector.shape == (16,) and abs(np.linalg.norm(vector) - 1) < 1e-5


def test_concurrent_embedding_requests_share_decodes_and_answer_each_its_own(base, engine):
    expected = engine.embed(TEXTS)

    def ask(i: int) -> np.ndarray:
        answer = httpx.post(f"{base}/v1/embeddings", json={"input": TEXTS[i % len(TEXTS)]}, timeout=60)
        assert answer.status_code == 200, answer.text
        return np.array(answer.json()["data"][0]["embedding"])

    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(ask, range(24)))
    for i, vector in enumerate(got):
        np.testing.assert_allclose(vector, expected[i % len(TEXTS)], atol=1e-4)


def test_bad_embedding_requests_get_a_400_naming_the_problem(base):
    cases = [
        ({"input": ["fine", ""]}, "input 1: empty input"),
        ({"input": "x", "dimensions": 65}, "dimensions must be between 1 and the model's 64"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": [[1, 2], [10**6]]}, "outside the vocabulary"),
        ({"input": "x", "pooling": "mean"}, "unknown field 'pooling'"),
        ({"input": "e t " * 1500}, "set truncate to cut it"),
    ]
    for body, message in cases:
        answer = httpx.post(f"{base}/v1/embeddings", json=body, timeout=60)
        assert answer.status_code == 400 and message in answer.json()["error"]["message"], (body, answer.text)
    assert httpx.post(f"{base}/v1/embeddings", json={"input": "e t " * 1500, "truncate": True}, timeout=60).status_code == 200
    no_head = httpx.post(f"{base}/v1/rerank", json={"query": "q", "documents": ["d"]}, timeout=60)
    assert no_head.status_code == 400 and "no rank head" in no_head.json()["error"]["message"]


def test_embedding_requests_count_in_the_queue_limit(serve):
    """--max-queue bounds embedding requests too: beyond it a 429 with Retry-After, never a lost
    request or a 500, and the server goes on answering."""
    url = serve(max_queue=1) + "/v1/embeddings"
    big = {"input": [f"{' '.join(['the capital of France'] * 30)} {i}" for i in range(150)]}
    with httpx.Client(timeout=120) as http, ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: http.post(url, json=big), range(12)))
        statuses = [a.status_code for a in answers]
        assert set(statuses) == {200, 429}, statuses
        refused = next(a for a in answers if a.status_code == 429)
        assert refused.headers["retry-after"] == "1" and "--max-queue 1" in refused.json()["error"]["message"]
        assert all(len(a.json()["data"]) == 150 for a in answers if a.status_code == 200)
        assert http.post(url, json={"input": "still here"}).status_code == 200


def test_rerank_answers_in_llama_server_and_jina_shape(serve, rank_model):
    base = serve(n_parallel=1, model=rank_model)
    documents = ["hello world", "Paris is the capital", "def fib(n):"]
    body = {"query": "the capital of France", "documents": documents, "top_n": 2, "return_documents": True}
    for route in ("/v1/rerank", "/rerank"):
        answer = httpx.post(f"{base}{route}", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        assert len(results) == 2 and results[0]["relevance_score"] >= results[1]["relevance_score"]
        assert all(r["document"]["text"] == documents[r["index"]] for r in results)
    with BatchEngine(rank_model, n_parallel=1, n_ctx=256, n_threads=2) as reranker:
        scores = reranker.rerank("the capital of France", documents)
    assert results[0]["index"] == int(np.argmax(scores))
    refused = httpx.post(f"{base}/v1/embeddings", json={"input": "x"}, timeout=60)
    assert refused.status_code == 400 and "is a reranker" in refused.json()["error"]["message"]


# -- jobs -----------------------------------------------------------------------------------


def test_a_batch_job_mixes_generation_and_embedding_lines(tiny_model, engine, tmp_path):
    lines = [
        {"custom_id": "gen", "url": "/v1/completions", "body": {"prompt": "the capital", "max_tokens": 4}},
        {"custom_id": "emb", "url": "/v1/embeddings", "body": {"input": TEXTS[:2]}},
        {"custom_id": "bad", "url": "/v1/embeddings", "body": {"input": ""}},
        {"custom_id": "chat", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = run_cli("batch", str(source), "-o", str(tmp_path / "out.jsonl"), "-m", str(tiny_model), "--json")
    assert done.returncode == 1, done.stderr  # the bad line failed, alone
    out = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, (tmp_path / "out.jsonl").open())}
    assert set(out) == {"gen", "emb", "chat"}
    assert out["gen"]["object"] == "text_completion" and out["chat"]["object"] == "chat.completion"
    np.testing.assert_allclose([d["embedding"] for d in out["emb"]["data"]], engine.embed(TEXTS[:2]), atol=1e-4)
    error = json.loads((tmp_path / "out.jsonl.errors.jsonl").read_text())
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert "empty input" in error["error"]["message"]


def test_embed_writes_jsonl_parquet_and_npy_in_input_order(tiny_model, engine, tmp_path):
    source = tmp_path / "texts.txt"
    source.write_text("\n".join(TEXTS[:3] + [""] + TEXTS[3:]) + "\n")  # a blank line is skipped, as in batch
    expected = engine.embed(TEXTS)
    for name in ("out.jsonl", "out.parquet", "out.npy"):
        done = run_cli("embed", str(source), "-o", str(tmp_path / name), "-m", str(tiny_model), "--json")
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout.splitlines()[-1])["summary"]
        assert summary["done"] == len(TEXTS) and summary["pooling"] == "mean"
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").open()]
    np.testing.assert_allclose([r["embedding"] for r in sorted(rows, key=lambda r: r["line"])], expected, atol=1e-4)
    table = pq.read_table(tmp_path / "out.parquet").sort_by("line")
    np.testing.assert_allclose(np.array(table.column("embedding").to_pylist()), expected, atol=1e-4)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy", mmap_mode="r"), expected, atol=1e-4)
    assert (tmp_path / "out.ids.txt").read_text().split() == ["line-1", "line-2", "line-3", "line-5", "line-6", "line-7"]


def test_embed_lines_fail_alone_and_a_changed_pooling_is_not_resumed(tiny_model, tmp_path):
    source = tmp_path / "in.jsonl"
    lines = [{"id": "a", "input": "hello"}, {"id": "b", "input": ""}, {"id": "c", "input": "hi", "dimensions": 999},
             {"id": "d", "input": ["two", "texts"]}, {"id": "e", "input": "the capital", "dimensions": 4}]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = run_cli("embed", str(source), "-o", str(tmp_path / "out.jsonl"), "-m", str(tiny_model))
    assert done.returncode == 1
    out = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").open())}
    assert set(out) == {"a", "d", "e"} and len(out["d"]["embeddings"]) == 2 and len(out["e"]["embedding"]) == 4
    errors = {r["id"]: r["error"]["message"] for r in map(json.loads, (tmp_path / "out.jsonl.errors.jsonl").open())}
    assert "empty input" in errors["b"] and "dimensions must be between" in errors["c"]
    # Two texts on a line cannot be one row of a .npy
    done = run_cli("embed", str(source), "-o", str(tmp_path / "out.npy"), "-m", str(tiny_model))
    errors = {r["id"]: r["error"]["message"] for r in map(json.loads, (tmp_path / "out.npy.errors.jsonl").open())}
    assert "one vector a line" in errors["d"]
    again = run_cli("embed", str(source), "-o", str(tmp_path / "out.jsonl"), "-m", str(tiny_model), "--pooling", "last")
    assert again.returncode != 0 and "pooling None -> 'last'" in again.stderr


def test_an_embed_job_killed_mid_run_resumes_and_writes_every_id_once(tiny_model, tmp_path):
    source = tmp_path / "texts.txt"
    words = ["the", "capital", "of", "France", "hello", "world", "Paris", "time"]
    n = 12000
    source.write_text("".join(f"{' '.join(words[(i + k) % 8] for k in range(1 + i % 6))} {i}\n" for i in range(n)))
    out = tmp_path / "out.parquet"
    job = subprocess.Popen([sys.executable, "-m", "llamabatch.cli", "embed", str(source), "-o", str(out), "-m", str(tiny_model)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(out.glob("part-*.parquet")) and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.02)
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    parts_at_kill = len(list(out.glob("part-*.parquet")))
    assert 1 <= parts_at_kill < n // 2048 + 1, "the job ended before the kill: nothing was tested"
    done = run_cli("embed", str(source), "-o", str(out), "-m", str(tiny_model), "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])["summary"]
    ids = pq.read_table(out, columns=["id"]).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == n and summary["skipped"] == parts_at_kill * 2048


def test_npy_assembly_puts_rows_of_many_parts_in_input_order(tmp_path):
    # Rows reach the parts in completion order, not input order: the .npy must undo that.
    rng = np.random.default_rng(1)
    n, dim = 5000, 3  # three parts of PART_ROWS
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    parts = ParquetParts(tmp_path / "out.npy.parts")
    parts.open(fresh=True)
    for line in rng.permutation(n):
        parts.write({"id": f"r{line}", "line": int(line), "embedding": vectors[line].tolist(),
                     "usage": {"prompt_tokens": 1}, "request_digest": "d"})
    parts.close()
    assert len(list(parts.path.glob("part-*.parquet"))) == 3
    assert write_npy(parts.path, tmp_path / "out.npy") == n
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), vectors)
    assert (tmp_path / "out.ids.txt").read_text().split() == [f"r{i}" for i in range(n)]
