"""Several models behind one server: each loaded by the first request that names it, unloaded
when idle or to make room (never with work in flight), a failed load retried by the next request.
Real servers on 127.0.0.1, the official openai client, two different tiny models."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from llamabatch import BatchEngine, SamplingParams
from llamabatch.serve.models import planned_bytes

from tiny_model import write_tiny_model

GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def two_models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("two")
    return {"alpha": write_tiny_model(folder / "alpha.gguf", seed=1), "beta": write_tiny_model(folder / "beta.gguf", seed=2)}


def settings_for(path: Path, n_ctx: int = 1024) -> dict:
    return {"model": path, "n_parallel": 2, "n_ctx": n_ctx, "n_threads": 2}


def several(serve, models: dict[str, Path], n_ctx: int = 1024, **settings) -> str:
    first = next(iter(models.values()))
    return serve(model=first, models={name: settings_for(path, n_ctx) for name, path in models.items()}, **settings)


def alone(path: Path, prompt: str) -> str:
    with BatchEngine(path, n_parallel=1, n_threads=2) as engine:
        return engine.generate([prompt], SamplingParams(**GREEDY))[0].text


def states(base: str) -> dict[str, str]:
    return {card["id"]: card["status"]["value"] for card in httpx.get(f"{base}/v1/models").json()["data"]}


def complete(base: str, model: str, prompt: str = "hello world", **extra) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": prompt, **GREEDY, **extra}, timeout=60)


def test_each_request_is_answered_by_the_model_it_names(serve, two_models):
    base = several(serve, two_models)
    assert states(base) == {"alpha": "unloaded", "beta": "unloaded"}  # nothing loads before it is asked for
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    expected = {name: alone(path, "hello world") for name, path in two_models.items()}
    assert expected["alpha"] != expected["beta"]  # two different models
    for name in ["alpha", "beta", "alpha", "beta"]:  # alternately, both staying loaded
        reply = client.completions.create(model=name, prompt="hello world", **{k: v for k, v in GREEDY.items() if k != "ignore_eos"},
                                          extra_body={"ignore_eos": True})
        assert reply.model == name and reply.choices[0].text == expected[name]
    assert states(base) == {"alpha": "loaded", "beta": "loaded"}
    assert sorted(m.id for m in client.models.list().data) == ["alpha", "beta"]
    metrics = httpx.get(f"{base}/metrics").text
    for name in two_models:
        assert f'llamabatch_generated_tokens_total{{class="interactive",model="{name}"}} 16.0' in metrics


def test_a_model_not_served_is_a_404_naming_those_that_are(serve, two_models):
    base = several(serve, two_models)
    reply = complete(base, "gamma")
    assert reply.status_code == 404 and "alpha, beta" in reply.json()["error"]["message"]


def test_past_max_loaded_the_least_recently_used_idle_model_unloads(serve, two_models):
    base = several(serve, two_models, max_loaded=1)
    assert complete(base, "alpha").status_code == 200
    assert states(base) == {"alpha": "loaded", "beta": "unloaded"}
    assert complete(base, "beta").status_code == 200
    assert states(base) == {"alpha": "unloaded", "beta": "loaded"}
    reply = complete(base, "alpha")  # loaded again, answering as before
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == alone(two_models["alpha"], "hello world")


def test_a_model_with_work_in_flight_is_never_unloaded_for_another(serve, two_models):
    base = several(serve, two_models, max_loaded=1)
    long_body = {"model": "alpha", "prompt": "a long one", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    finished: dict[str, float] = {}

    def stream_alpha() -> None:
        with httpx.stream("POST", f"{base}/v1/completions", json=long_body, timeout=120) as reply:
            chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
        finished["alpha"] = time.monotonic()
        finished["alpha_reason"] = next(c["choices"][0]["finish_reason"] for c in reversed(chunks) if c["choices"])

    thread = threading.Thread(target=stream_alpha)
    thread.start()
    deadline = time.monotonic() + 30
    while states(base)["alpha"] != "loaded" and time.monotonic() < deadline:
        time.sleep(0.02)
    reply = complete(base, "beta")  # waits for alpha's stream to end, then alpha unloads for it
    beta_done = time.monotonic()
    thread.join()
    assert reply.status_code == 200
    assert finished["alpha_reason"] == "length"  # all 400 tokens: the stream was not cut
    assert beta_done >= finished["alpha"]
    assert states(base) == {"alpha": "unloaded", "beta": "loaded"}


def test_an_idle_model_sleeps_after_sleep_idle_seconds(serve, two_models):
    base = several(serve, two_models, idle_unload=0.5)
    assert complete(base, "beta").status_code == 200
    assert states(base)["beta"] == "loaded"
    deadline = time.monotonic() + 10
    while states(base)["beta"] != "sleeping" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert states(base) == {"alpha": "unloaded", "beta": "sleeping"}  # (alpha was never loaded)
    assert complete(base, "beta").status_code == 200  # and loads again when asked for


def test_one_model_sleeps_when_idle_answers_health_models_and_metrics_asleep_and_wakes_for_a_request(serve, tiny_model):
    """--sleep-idle with one model: its engine is closed once idle; /health, /v1/models and
    /metrics say so without loading it; the next request loads it and is answered as before."""
    base = serve(n_parallel=2, idle_unload=0.5)
    first = complete(base, "tiny")
    assert first.status_code == 200

    def loaded_gauge() -> str:
        return next(line for line in httpx.get(f"{base}/metrics").text.splitlines() if line.startswith("llamabatch_model_loaded{"))

    assert loaded_gauge().endswith(" 1.0")
    deadline = time.monotonic() + 10
    while states(base)["tiny"] != "sleeping" and time.monotonic() < deadline:
        time.sleep(0.1)
    for _ in range(3):  # asking how it is does not wake it
        assert httpx.get(f"{base}/health").json() == {"status": "ok", "model": "sleeping"}
        assert states(base) == {"tiny": "sleeping"} and loaded_gauge().endswith(" 0.0")
    again = complete(base, "tiny")
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert states(base) == {"tiny": "loaded"} and httpx.get(f"{base}/health").json() == {"status": "ok"}


def test_a_failed_load_fails_its_requests_and_the_next_request_tries_again(serve, two_models, tmp_path):
    broken = tmp_path / "gamma.gguf"
    broken.write_bytes(b"GGUF but not a model")
    base = several(serve, {**two_models, "gamma": broken})
    replies = []
    threads = [threading.Thread(target=lambda: replies.append(complete(base, "gamma"))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.status_code for r in replies] == [503] * 3
    assert all("model gamma failed to load" in r.json()["error"]["message"] for r in replies)
    card = next(c for c in httpx.get(f"{base}/v1/models").json()["data"] if c["id"] == "gamma")
    assert card["status"]["value"] == "unloaded" and card["status"]["failed"]
    assert complete(base, "alpha").status_code == 200  # the server goes on
    write_tiny_model(broken, seed=3)  # the file is fixed: the next request loads it
    reply = complete(base, "gamma")
    assert reply.status_code == 200, reply.text
    assert states(base)["gamma"] == "loaded"


def test_the_memory_budget_holds_as_many_models_as_fit(serve, two_models):
    one = planned_bytes(settings_for(two_models["alpha"]))
    base = several(serve, two_models, memory=int(one * 1.5))  # room for one
    assert complete(base, "alpha").status_code == 200
    assert complete(base, "beta").status_code == 200
    assert states(base) == {"alpha": "unloaded", "beta": "loaded"}
    cards = {c["id"]: c for c in httpx.get(f"{base}/v1/models").json()["data"]}
    assert cards["beta"]["memory_bytes"] > 0


def test_a_model_larger_than_the_budget_is_refused_with_the_sizes(serve, two_models):
    base = several(serve, two_models, memory=1 << 20)
    reply = complete(base, "alpha")
    assert reply.status_code == 503 and "more than --memory" in reply.json()["error"]["message"]


def test_llama_servers_load_and_unload_routes(serve, two_models):
    base = several(serve, two_models)
    assert httpx.post(f"{base}/models/load", json={"model": "beta"}, timeout=60).json() == {"success": True}
    assert states(base)["beta"] == "loaded"
    assert httpx.post(f"{base}/models/unload", json={"model": "beta"}).json() == {"success": True}
    assert states(base)["beta"] == "unloaded"
    assert httpx.post(f"{base}/models/load", json={"model": "nope"}).status_code == 404



def test_a_model_with_requests_in_flight_is_not_unloaded_on_request(serve, two_models):
    base = several(serve, two_models, n_ctx=2 * 8192)
    body = {"model": "alpha", "prompt": "busy", "max_tokens": 8000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as reply:
        lines = reply.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # generating
        busy = httpx.post(f"{base}/models/unload", json={"model": "alpha"})
        assert busy.status_code == 409 and "in flight" in busy.json()["error"]["message"]
        for _ in lines:
            pass
    assert httpx.post(f"{base}/models/unload", json={"model": "alpha"}).status_code == 200


def test_embeddings_and_the_tokenizer_per_model(serve, two_models):
    base = several(serve, two_models)
    for name in two_models:
        reply = httpx.post(f"{base}/v1/embeddings", json={"model": name, "input": "hello"}, timeout=60).json()
        assert reply["model"] == name and len(reply["data"][0]["embedding"]) == 64
        tokens = httpx.post(f"{base}/tokenize", json={"model": name, "prompt": "hello"}).json()["tokens"]
        assert tokens and json.dumps(tokens)


def test_a_batch_runs_on_the_model_its_requests_name(serve, two_models, tmp_path):
    import io

    base = several(serve, two_models, data_dir=tmp_path)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "beta", "prompt": "hello world", **GREEDY}} for i in range(3)]
    source = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, rows)).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions", completion_window="24h")
    assert batch.model == "beta"
    deadline = time.monotonic() + 60
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    answers = [json.loads(line)["response"]["body"] for line in client.files.content(batch.output_file_id).text.splitlines()]
    expected = alone(two_models["beta"], "hello world")
    assert all(a["model"] == "beta" and a["choices"][0]["text"] == expected for a in answers)
    assert states(base) == {"alpha": "unloaded", "beta": "loaded"}
