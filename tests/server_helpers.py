"""Run the HTTP server in-process on a loopback port for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from serve.api_server import build_app
from serve_helpers import engine

MODEL_NAME = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(api_key: str | None = None, max_queue: int = 64, request_timeout: float | None = 120,
                   **engine_kwargs) -> Iterator[tuple[str, object]]:
    """Yields (base_url, app) with the engine loop and uvicorn running; stops both afterwards."""
    eng = engine(**engine_kwargs)
    app = build_app(eng, model_name=MODEL_NAME, api_key=api_key, max_queue=max_queue,
                    request_timeout=request_timeout)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        app.state.server.engine.shutdown()
