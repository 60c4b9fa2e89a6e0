"""Images a request names by http(s) URL, fetched where the server allows it (`serve
--allow-remote-media`): over http or https only, within TIMEOUT_S, at most MAX_BYTES each. The
server then asks other hosts for what its clients name, so it is off unless asked for."""

from __future__ import annotations

import httpx

from ..errors import PromptError

MAX_BYTES = 20 << 20
TIMEOUT_S = 10.0
MAX_REDIRECTS = 3


def fetch(url: str) -> bytes:
    """The file at `url`; PromptError naming the URL and why it could not be had."""
    try:
        with httpx.Client(timeout=TIMEOUT_S, follow_redirects=True, max_redirects=MAX_REDIRECTS) as client, \
                client.stream("GET", url, headers={"Accept": "image/*, audio/*"}) as response:
            if response.status_code != 200:
                raise PromptError(f"fetching {url}: HTTP {response.status_code}")
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > MAX_BYTES:
                    raise PromptError(f"fetching {url}: larger than {MAX_BYTES / 2**20:g} MiB")
            return bytes(data)
    except httpx.HTTPError as e:
        raise PromptError(f"fetching {url}: {type(e).__name__}: {e}") from None
