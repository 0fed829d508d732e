"""uvicorn that drains on SIGTERM (serve.http.drain says when a drain is over): new requests get 503
until the in-flight ones are done or the drain timeout passes, then it exits 0."""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

from serve.http.state import ServerState

log = logging.getLogger("jaxinfra.serve")


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
