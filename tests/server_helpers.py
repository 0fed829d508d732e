"""Run the HTTP server in-process (its engine core in a child process) on a loopback port for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
from fastapi import FastAPI

from serve import EngineArgs
from serve.engine.async_engine import AsyncEngine
from serve.http.app import build_app
from tests.serve_helpers import ENGINE_DEFAULTS

MODEL_NAME = "tiny"


def stream_body(max_tokens: int) -> dict:
    """A greedy streamed completion that runs its full length (no EOS), with a usage chunk: the
    background stream the robustness and reliability probes run beside their bad requests."""
    return {
        "model": MODEL_NAME,
        "prompt": "keep going",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int | None = None) -> Iterator[str]:
    """Run `app` with uvicorn on a background thread; yields its URL. Stopping it shuts the engine down."""
    import uvicorn

    if port is None:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            app.state.server.engine.shutdown()
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        app.state.server.engine.shutdown()


@contextlib.contextmanager
def running_server(
    api_key: str | None = None,
    api_keys: dict | None = None,
    max_queue: int = 64,
    request_timeout: float | None = 120,
    warmup: bool = False,
    restart_on_failure: bool = False,
    **engine_kwargs,
) -> Iterator[tuple[str, object]]:
    """Yields (base_url, app) with the engine core and uvicorn running; stops both afterwards."""
    engine = AsyncEngine(
        EngineArgs(**{**ENGINE_DEFAULTS, **engine_kwargs}), warmup=warmup, restart_on_failure=restart_on_failure
    )
    app = build_app(
        engine,
        model_name=MODEL_NAME,
        api_key=api_key,
        api_keys=api_keys,
        max_queue=max_queue,
        request_timeout=request_timeout,
    )
    with serve_in_thread(app) as url:
        yield url, app


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of the server's Prometheus metrics (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def eventually(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Wait for a condition with a deadline (never a fixed sleep before an assert)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def call(app, method: str, *args):
    """A utility call on the server's engine core, from the test thread."""
    import asyncio

    engine = app.state.server.engine
    return asyncio.run_coroutine_threadsafe(engine.call(method, *args), app.state.loop).result(timeout=30)


def core_stats(app):
    return call(app, "stats")
