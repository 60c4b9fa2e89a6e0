"""Stopping the server in order, on SIGINT or SIGTERM.

1. Intake stops: every route answers 503 "the server is stopping" (a load balancer's health check
   sees it too), while the requests in flight go on.
2. They drain for up to --shutdown-timeout seconds; those still open then end with that error,
   in the same shape as any failure of the engine (a stream's last chunk says so).
3. uvicorn closes the listeners and the connections; the app's lifespan then stops each engine
   thread (joined within --shutdown-timeout), syncs the batches in progress and leaves them for
   the next start, closes the engines, and last closes the store once its writes are done.

A second Ctrl-C skips what is left of the drain.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import uvicorn
from uvicorn.server import STARTUP_FAILURE

from .models import ModelPool
from .worker import STOPPING

ENDING_S = 5.0  # for requests ended with an error to send it and close
POLL_S = 0.05


class Server(uvicorn.Server):
    """uvicorn's server, which drains the model pool's requests before it shuts down."""

    def __init__(self, config: uvicorn.Config, models: ModelPool, timeout: float) -> None:
        super().__init__(config)
        self.models, self.timeout = models, timeout

    async def main_loop(self) -> None:
        await super().main_loop()  # until a signal asks the server to stop
        await self.drain()

    async def drain(self) -> None:
        self.models.refuse(STOPPING)
        await self._settle(self.timeout)
        if self.models.requests_in_flight:
            self.models.end_requests(STOPPING)
            await self._settle(ENDING_S)

    async def _settle(self, seconds: float) -> None:
        """Wait until no request is in flight, `seconds` pass, or a second signal comes."""
        deadline = time.monotonic() + seconds
        while self.models.requests_in_flight and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(POLL_S)


def serve_until_stopped(app, host: str, port: int, log_level: str, timeout: float, tls: tuple[Path, Path] | None = None) -> None:
    """Serve `app` (create_app's) on host:port until a signal, then stop in order with `timeout`
    seconds to drain (as uvicorn.run, whose exit on a failed start it keeps); `tls`: HTTPS with
    this certificate and key."""
    # uvicorn's own wait for connections comes after the drain: by then only closing is left.
    certfile, keyfile = tls or (None, None)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=int(ENDING_S),
                            ssl_certfile=certfile, ssl_keyfile=keyfile)
    server = Server(config, app.state.models, timeout)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the signal it caught again once it has stopped
        pass
    if not server.started:
        sys.exit(STARTUP_FAILURE)
