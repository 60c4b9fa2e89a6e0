"""A real browser for the tests and benchmarks: headless Chromium (Debian's `chromium`), driven over the Chrome
DevTools Protocol on a loopback port with the `websockets` client: open a page, evaluate
JavaScript in it (awaiting promises), wait until an expression holds."""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path

import httpx
from websockets.sync.client import connect

from .servers import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, ws) -> None:
        self.ws, self._ids = ws, itertools.count(1)

    @classmethod
    @contextmanager
    def started(cls) -> Iterator[Browser]:
        port = free_port()
        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
            process = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                        f"--remote-debugging-port={port}", f"--user-data-dir={profile}", "about:blank"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            try:
                with connect(cls._page_socket(port), max_size=None, open_timeout=30) as ws:
                    browser = cls(ws)
                    browser.send("Runtime.enable")
                    yield browser
            finally:
                os.killpg(process.pid, signal.SIGKILL)  # chromium and the processes it started
                process.wait()

    @staticmethod
    def _page_socket(port: int) -> str:
        deadline = time.monotonic() + 30
        while True:
            try:
                pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("chromium did not start")
            time.sleep(0.1)

    def send(self, method: str, **params) -> dict:
        message_id = next(self._ids)
        self.ws.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == message_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def open(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self.wait("document.readyState === 'complete' && location.href !== 'about:blank'")

    def js(self, expression: str):
        """The expression's value in the page (a promise awaited)."""
        result = self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path, width: int = 1280, height: int = 900, selector: str | None = None) -> None:
        """The page, in a window of this size, as a PNG: all of the window, or the element the
        CSS selector picks."""
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        clip = {}
        if selector is not None:
            box = self.js(f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect(); "
                          "return {x: r.x + scrollX, y: r.y + scrollY, width: r.width, height: r.height, scale: 1}; })()")
            clip = {"clip": box, "captureBeyondViewport": True}
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png", **clip)["data"]))

    def wait(self, expression: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while True:
            value = self.js(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"never true in the page: {expression}")
            time.sleep(0.1)
