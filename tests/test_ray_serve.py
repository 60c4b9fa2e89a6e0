"""`llamabatch serve --replicas 2` on a local Ray instance, through the official openai client:
requests spread over both replicas, and a prompt whose prefix a replica served goes back to it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from conftest import free_port  # noqa: E402

REPLICA_HEADER = "x-llamabatch-replica"


@pytest.fixture(scope="module")
def replicas(tiny_model, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    command = [str(Path(sys.executable).parent / "llamabatch"), "serve", "-m", str(tiny_model), "--replicas", "2",
               "--parallel", "4", "--port", str(port)]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert process.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    else:
        pytest.fail("the replicas did not come up:\n" + log.read_text()[-3000:])
    yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def complete(client, prompt: str, max_tokens: int = 16) -> tuple[str, str]:
    """(the replica that answered, the text)."""
    raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)
    return raw.headers[REPLICA_HEADER], raw.parse().choices[0].text


def test_concurrent_requests_spread_over_both_replicas(replicas):
    prompts = [f"{i * 7919} is the number; request {i}" for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        answered = list(pool.map(lambda p: complete(replicas, p, 32), prompts))
    served = [replica for replica, _ in answered]
    assert len(set(served)) == 2, served
    assert all(text for _, text in answered)


def test_a_request_goes_to_the_replica_that_served_its_prefix(replicas):
    prefixes = [f"System {k}: you are assistant number {k}. " + "Follow the rules carefully and answer briefly. " * 6
                for k in range(6)]
    first = [complete(replicas, p + "Question: what is one plus one?", 4)[0] for p in prefixes]
    again = [complete(replicas, p + "Question: name a colour.", 4)[0] for p in prefixes]
    assert again == first
    assert len(set(first)) == 2, first  # new prefixes were spread too, not all sent to one replica


def test_streams_and_errors_pass_through(replicas):
    chunks = list(replicas.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) >= 2
    with pytest.raises(openai.BadRequestError, match="temperature"):
        replicas.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=-1)
