"""Graceful shutdown on SIGTERM (what Kubernetes and Ray send): stop admitting (503 for new
requests, /health 503 so load balancers look elsewhere), let in-flight requests and streams finish
within `--drain-timeout` seconds, then exit 0. A second SIGTERM, or SIGINT, exits at once.
The server that acts on it is serve.http.draining_server.
"""

from __future__ import annotations

import time


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
