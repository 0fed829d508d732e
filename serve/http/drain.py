"""Graceful shutdown on SIGTERM (what Kubernetes and Ray send): stop admitting (503 for new
requests, /health 503 so load balancers look elsewhere), let in-flight requests and streams finish
within `--drain-timeout` seconds, then exit 0. A second SIGTERM, or SIGINT, exits at once.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

if TYPE_CHECKING:
    from serve.http.state import ServerState

log = logging.getLogger("jaxinfra.serve")


class Drain:
    """Whether the server is draining, and until when. Held as `ServerState.drain`."""

    open_paths = frozenset({"/metrics", "/status", "/version", "/ping"})  # still answered while draining

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.deadline: float | None = None

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def begin(self) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.timeout_s

    def over(self, in_flight: int) -> bool:
        """The drain is done: nothing left in flight, or the deadline passed."""
        return self.deadline is not None and (in_flight <= 0 or time.monotonic() >= self.deadline)


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM starts a drain instead of closing the listening socket: new
    requests still get an answer (503) until the in-flight ones are done."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state, self.drain = state, state.drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.drain.draining:
            log.warning(
                "SIGTERM: draining (%d sequences in flight, %.0f s at most)", self.state.in_flight, self.drain.timeout_s
            )
            self.drain.begin()
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.over(self.state.in_flight):
            self.should_exit = True
        return await super().on_tick(counter)


def serve_draining(app: FastAPI, host: str, port: int, drain_timeout: float) -> None:
    """Run `app` until SIGINT, or until a SIGTERM's drain is over."""
    state: ServerState = app.state.server
    state.drain.timeout_s = drain_timeout
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    DrainingServer(config, state).run()
