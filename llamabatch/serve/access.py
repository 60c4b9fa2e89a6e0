"""Who may call the server: API keys (asked on every route but /health, and /metrics unless the
operator makes it private too), and the browser origins allowed to call it (CORS)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from starlette.middleware.cors import CORSMiddleware

from ..errors import LlamabatchError


@dataclass(frozen=True)
class Access:
    api_keys: frozenset[str] = frozenset()  # none: no key asked
    private_metrics: bool = False  # /metrics asks for a key too
    cors_origins: tuple[str, ...] = ()  # "*" for any; none: no CORS headers, browsers refuse other origins
    cors_methods: tuple[str, ...] = ("GET", "POST", "DELETE")
    cors_headers: tuple[str, ...] = ("*",)  # the official clients send headers of their own (x-stainless-*, anthropic-version)

    def authorization(self):
        """The dependency every keyed route takes: 401 without one of the keys, given as
        `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""
        keys = [key.encode() for key in self.api_keys]

        async def check(http: Request) -> None:
            if not keys:
                return
            authorization = http.headers.get("authorization", "")
            bearer = authorization[len("Bearer "):].encode() if authorization.startswith("Bearer ") else b""
            given = http.headers.get("x-api-key", "").encode()
            # every key compared, whichever matches: the time taken says nothing about them
            if not sum(secrets.compare_digest(bearer, key) | secrets.compare_digest(given, key) for key in keys):
                raise HTTPException(401, "missing or wrong API key (Authorization: Bearer KEY, or x-api-key: KEY)")

        return check

    def allow_origins(self, app: FastAPI) -> None:
        """Answer browsers' preflight requests and mark responses for the allowed origins."""
        if self.cors_origins:
            app.add_middleware(CORSMiddleware, allow_origins=list(self.cors_origins), allow_methods=list(self.cors_methods),
                               allow_headers=list(self.cors_headers), max_age=600)


def read_keys(path: Path) -> list[str]:
    """API keys, one a line; blank lines and lines starting with # are skipped."""
    if not path.is_file():
        raise LlamabatchError(f"--api-key-file: file not found: {path}")
    keys = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise LlamabatchError(f"--api-key-file {path} holds no keys (one a line; # starts a comment)")
    return keys
