"""A screenshot of the server's web page for docs/guides/server.md: a server on the default model
with a batch running and two playground chats, in headless Chromium.

    python scripts/page_screenshots.py   # writes docs/images/page-*.png
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


def main() -> None:
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = "gemma3-270m"  # by its catalog name: its chat template is the catalog's
        with llamabatch_serve(model, "--parallel", 4, "--ctx", 8192, "-t", 2, "--data-dir", Path(tmp) / "data") as server, \
                Browser.started() as browser:
            lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                      "body": {"prompt": f"Fact {i} about the sea:", "max_tokens": 64}} for i in range(200)]
            data = "".join(json.dumps(line) + "\n" for line in lines).encode()
            file = httpx.post(f"{server.base}/v1/files", files={"file": ("jobs.jsonl", io.BytesIO(data))}, data={"purpose": "batch"}).json()
            httpx.post(f"{server.base}/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
            browser.open(server.base + "/")
            browser.wait("document.getElementById('inview').value !== ''")
            browser.js("document.getElementById('newchat').click()")
            for k, text in enumerate(["Name three rivers.", "Write a haiku about rain."]):
                browser.js(f"""(() => {{ const chat = document.querySelectorAll('.chat')[{k}];
                    chat.querySelector('.system').value = 'Be brief.'; chat.querySelector('.max-tokens').value = '48';
                    chat.querySelector('.message').value = {json.dumps(text)}; chat.querySelector('.send').click(); }})()""")
            browser.wait("[...document.querySelectorAll('.chat .usage')].every(u => u.textContent)", timeout=60)
            time.sleep(8)  # the chart fills with a few seconds of readings
            browser.screenshot(OUT / "page.png", height=1100)
            print(f"wrote {OUT / 'page.png'}")


if __name__ == "__main__":
    main()
