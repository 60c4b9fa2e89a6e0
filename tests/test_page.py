"""The server's web page in a real browser (headless Chromium): it shows the models and their
figures from the engine's snapshot, streams a playground chat as the API answers it, runs and
cancels a batch uploaded through it, and asks for a key where the server wants one."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from benchmarks.browser import CHROMIUM, Browser
from conftest import Faults
from llamabatch.serve.access import Access
from llamabatch.serve.page_api import PAGE

ESLINT = shutil.which("eslint")
in_browser = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium; CI installs it)")


@pytest.mark.skipif(ESLINT is None, reason="no eslint (apt-get install eslint; CI installs it)")
def test_the_page_script_passes_eslint(tmp_path):
    """ESLint's recommended rules and a few of its own (tests/data/page.eslintrc.json) on the
    page's one script."""
    script = tmp_path / "page.js"
    script.write_text(re.search(r"<script>(.*?)</script>", PAGE.read_text(encoding="utf-8"), re.S).group(1))
    config = Path(__file__).parent / "data" / "page.eslintrc.json"
    # Debian's eslint finds its modules on NODE_PATH when node is not Debian's own
    env = {**os.environ, "NODE_PATH": os.pathsep.join(filter(None, [os.environ.get("NODE_PATH"), "/usr/share/nodejs"]))}
    linted = subprocess.run([ESLINT, "--no-eslintrc", "-c", str(config), script.name], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert linted.returncode == 0, linted.stdout + linted.stderr


@pytest.fixture(scope="module")
def site(serve, tmp_path_factory) -> str:
    return serve(n_parallel=2, n_ctx=2048, data_dir=tmp_path_factory.mktemp("page") / "data")


@pytest.fixture(scope="module")
def browser():
    with Browser.started() as started:
        yield started


@in_browser
def test_the_page_shows_each_model_and_its_throughput(site, browser):
    browser.open(site + "/")
    browser.wait("[...document.querySelectorAll('#models tr.model')].some(r => r.cells[0].textContent === 'tiny' && r.cells[1].textContent === 'loaded')")
    assert browser.js("document.querySelector('#models tr.model').cells[2].textContent") == "0 of 2"
    httpx.post(f"{site}/v1/completions", json={"prompt": "hello", "max_tokens": 300, "ignore_eos": True}, timeout=60)
    # the page made a rate of two readings of the engine's token counter: it moved
    browser.wait("(readingsOf.tiny || []).some((r, i, all) => i > 0 && r.tokens > all[i - 1].tokens)", timeout=10)
    assert browser.js("document.getElementById('facts').textContent").startswith("attention, context 2048 a sequence")


@in_browser
def test_the_playground_streams_the_answer_the_api_gives(site, browser):
    browser.open(site + "/")
    browser.wait("document.getElementById('inview').value === 'tiny'")
    browser.js("""(() => { const chat = document.querySelector('.chat');
        chat.querySelector('.temperature').value = '0'; chat.querySelector('.max-tokens').value = '12';
        chat.querySelector('.message').value = 'Say hello'; chat.querySelector('.send').click(); })()""")
    usage = browser.wait("document.querySelector('.chat .usage').textContent")
    shown = browser.js("document.querySelector('.chat .answer').textContent")
    client = openai.OpenAI(base_url=f"{site}/v1", api_key="none", max_retries=0)
    expected = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hello"}], temperature=0, max_tokens=12)
    assert shown == expected.choices[0].message.content
    assert f"answer {expected.usage.completion_tokens} tokens" in usage and "first token" in usage


@in_browser
def test_the_playground_shows_a_tool_call_as_a_call(site, browser):
    browser.open(site + "/")
    browser.wait("document.getElementById('inview').value === 'tiny'")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"], "additionalProperties": False}}}]
    browser.js(f"""(() => {{ const chat = document.querySelector('.chat');
        chat.querySelector('.tools').value = {json.dumps(json.dumps(tools))}; chat.querySelector('.tool-choice').value = 'required';
        chat.querySelector('.temperature').value = '0'; chat.querySelector('.max-tokens').value = '200';
        chat.querySelector('.message').value = 'Weather in Oslo?'; chat.querySelector('.send').click(); }})()""")
    browser.wait("document.querySelector('.chat .usage').textContent")
    shown = browser.js("document.querySelector('.chat .call').textContent")
    calls = [line.partition("(") for line in shown.splitlines()]  # one line a call (parallel calls allowed)
    assert calls and all(name == "get_weather" and len(json.loads(arguments[:-1])["city"]) <= 8 for name, _, arguments in calls)


def _completions(n: int, prefix: str, max_tokens: int, prompt: str = "line") -> list[dict]:
    """A batch input of n completions."""
    return [{"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": f"{prompt} {i}", "max_tokens": max_tokens}} for i in range(n)]


def _pick(browser: Browser, lines: list[dict]) -> None:
    text = json.dumps("".join(json.dumps(line) + "\n" for line in lines))
    browser.js(f"""(() => {{ const input = document.getElementById('file'), files = new DataTransfer();
        files.items.add(new File([{text}], 'jobs.jsonl')); input.files = files.files;
        input.dispatchEvent(new Event('change')); }})()""")
    browser.wait("!document.getElementById('start').disabled")


@in_browser
def test_a_picked_file_shows_its_estimate(site, browser):
    browser.open(site + "/")
    _pick(browser, _completions(4, "e", 5))
    shown = browser.wait("document.getElementById('filefigures').textContent.includes('prompt tokens') && document.getElementById('filefigures').textContent")
    file_id = browser.js("uploaded.id")
    guess = httpx.get(f"{site}/v1/files/{file_id}/estimate").json()
    assert (guess["requests"], guess["max_new_tokens"], guess["model"]) == (4, 20, "tiny")
    assert shown.startswith("4 requests to /v1/completions · ") and f"{guess['prompt_tokens']} prompt tokens, at most 20 generated" in shown


@in_browser
def test_a_request_that_fails_in_the_engine_is_listed_under_recent_errors(serve, browser, monkeypatch):
    base = serve(n_parallel=1)
    browser.open(base + "/")
    browser.wait("!document.getElementById('nofailures').classList.contains('hidden')")
    Faults(monkeypatch, code=1, times=1)  # llama_decode: no KV slot for the batch
    failed = httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
    assert failed.status_code == 500
    row = browser.wait("document.querySelector('#failures tr.failure') && [...document.querySelector('#failures tr.failure').cells].map(c => c.textContent)")
    assert row[1:3] == ["tiny", "interactive"] and row[3] == failed.json()["error"]["message"]


@in_browser
def test_a_batch_started_from_the_page_runs_and_one_is_cancelled_there(site, browser):
    browser.open(site + "/")
    _pick(browser, _completions(6, "q", 4))
    assert browser.js("document.getElementById('filefigures').textContent").startswith("6 requests to /v1/completions")
    browser.js("document.getElementById('start').click()")
    browser.wait("[...document.querySelectorAll('#batches tr.batch')].some(r => r.cells[1].textContent === 'completed' && r.cells[2].textContent === '6 of 6' && !!r.querySelector('a.output_file_id'))")
    browser.js("document.querySelector('#batches tr.batch a.output_file_id').click()")  # fetched with the page's key, kept as a blob
    browser.wait("[...document.querySelectorAll('#batches a.output_file_id')].some(a => a.href.startsWith('blob:') && a.download.endsWith('-output.jsonl'))")
    long = [{"custom_id": f"long{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 1500, "ignore_eos": True}}
            for i in range(60)]
    _pick(browser, long)
    browser.js("document.getElementById('start').click()")
    browser.wait("!!document.querySelector('#batches tr.batch button.cancel')")
    batch_id = browser.js("document.querySelector('#batches tr.batch button.cancel').closest('tr').dataset.id")
    browser.js("document.querySelector('#batches tr.batch button.cancel').click()")
    browser.wait(f"[...document.querySelectorAll('#batches tr.batch')].some(r => r.dataset.id === '{batch_id}' && r.cells[1].textContent === 'cancelled')")
    assert httpx.get(f"{site}/v1/batches/{batch_id}").json()["status"] == "cancelled"


@in_browser
def test_a_server_that_wants_a_key_gets_it_from_the_page(serve, browser):
    keyed = serve(n_parallel=1, access=Access(api_keys=frozenset({"s3cret"})))
    browser.open(keyed + "/")
    browser.wait("!document.getElementById('keybox').classList.contains('hidden')")
    browser.js("document.getElementById('key').value = 's3cret'; document.getElementById('keysave').click()")
    browser.wait("[...document.querySelectorAll('#models tr.model')].some(r => r.cells[1].textContent === 'loaded')")
    assert httpx.get(f"{keyed}/v1/dashboard").status_code == 401
