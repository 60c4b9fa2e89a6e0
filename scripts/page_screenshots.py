"""Screenshots of the server's web page for docs/guides/server.md: a server on the default model
with a batch running, a second file picked and estimated, and two playground chats (one answered
with a tool call), in headless Chromium. The estimate's time is `llamabatch tune`'s measurement
for the server's settings (run `llamabatch tune -m gemma3-270m -t 2` first to show one).

    python scripts/page_screenshots.py   # writes docs/images/page*.png
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.browser import Browser  # noqa: E402
from benchmarks.servers import llamabatch_serve  # noqa: E402

OUT = ROOT / "docs" / "images"
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}}, "required": ["city"]}}}]


def jobs(n: int, prefix: str) -> list[dict]:
    return [{"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": f"Fact {i} about the sea:", "max_tokens": 64}} for i in range(n)]


def start_batch(base: str) -> None:
    data = "".join(json.dumps(line) + "\n" for line in jobs(200, "q")).encode()
    file = httpx.post(f"{base}/v1/files", files={"file": ("jobs.jsonl", io.BytesIO(data))}, data={"purpose": "batch"}).json()
    httpx.post(f"{base}/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h"})


def pick(browser: Browser, lines: list[dict]) -> None:
    """A file picked in the page's upload box, and its estimate shown."""
    text = json.dumps("".join(json.dumps(line) + "\n" for line in lines))
    browser.js(f"""(() => {{ const input = document.getElementById('file'), files = new DataTransfer();
        files.items.add(new File([{text}], 'questions.jsonl')); input.files = files.files;
        input.dispatchEvent(new Event('change')); }})()""")
    browser.wait("document.getElementById('filefigures').textContent.includes('prompt tokens')", timeout=60)


def chat(browser: Browser, k: int, text: str, tools: list | None = None) -> None:
    browser.js(f"""(() => {{ const chat = document.querySelectorAll('.chat')[{k}];
        chat.querySelector('.system').value = 'Be brief.'; chat.querySelector('.max-tokens').value = '48';
        {f"chat.querySelector('.tools').value = {json.dumps(json.dumps(tools))}; chat.querySelector('.tool-choice').value = 'required'; chat.querySelector('.temperature').value = '0';" if tools else ""}
        chat.querySelector('.message').value = {json.dumps(text)}; chat.querySelector('.send').click(); }})()""")


def main() -> None:
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = "gemma3-270m"  # by its catalog name: its chat template is the catalog's
        with llamabatch_serve(model, "--parallel", 4, "--ctx", 8192, "-t", 2, "--data-dir", Path(tmp) / "data") as server, \
                Browser.started() as browser:
            start_batch(server.base)
            browser.open(server.base + "/")
            browser.wait("document.getElementById('inview').value !== ''")
            pick(browser, jobs(500, "p"))
            browser.js("document.getElementById('newchat').click()")
            chat(browser, 0, "Name three rivers.")
            chat(browser, 1, "What is the weather in Oslo?", WEATHER)
            browser.wait("[...document.querySelectorAll('.chat .usage')].every(u => u.textContent)", timeout=60)
            time.sleep(8)  # the chart fills with a few seconds of readings
            shots = [("page.png", None), ("page-models.png", "#models-section"),
                     ("page-batches.png", "#batches-section"), ("page-playground.png", "#playground")]
            for name, selector in shots:
                browser.screenshot(OUT / name, height=1100, selector=selector)
                print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
