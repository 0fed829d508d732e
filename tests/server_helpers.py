"""Run the HTTP server in-process on a loopback port for tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from serve.api_server import build_app, serve_in_thread
from serve_helpers import engine

MODEL_NAME = "tiny"


@contextlib.contextmanager
def running_server(api_key: str | None = None, max_queue: int = 64, request_timeout: float | None = 120,
                   **engine_kwargs) -> Iterator[tuple[str, object]]:
    """Yields (base_url, app) with the engine loop and uvicorn running; stops both afterwards."""
    app = build_app(engine(**engine_kwargs), model_name=MODEL_NAME, api_key=api_key, max_queue=max_queue,
                    request_timeout=request_timeout)
    with serve_in_thread(app) as url:
        yield url, app
