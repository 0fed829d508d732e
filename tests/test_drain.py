"""Graceful shutdown of a real `jaxinfra serve` process: after SIGTERM new requests get 503 (and
/health 503), the stream already running finishes whole, then the process exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server_helpers import eventually

MODEL = "tiny-qwen3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_refuses_new_requests_finishes_streams_then_exits():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        *("serve", "--model", MODEL, "--port", str(port), "--no-warmup", "--compilation-cache-dir", ""),
        *("--max-model-len", "1024", "--block-size", "16", "--drain-timeout", "120"),
    ]
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfra", *command], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200  # compiled

        events: list[dict] = []
        first, done_at = threading.Event(), []

        def stream() -> None:
            streamed = {**body, "max_tokens": 900, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=streamed, timeout=120) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done_at.append(time.monotonic())
                    elif line.startswith("data: "):
                        events.append(json.loads(line[6:]))
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        assert eventually(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 503)
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        refused_at = time.monotonic()
        reader.join(120)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_draining"
        assert done_at and refused_at < done_at[0], "the stream ended before the refused request: no drain seen"
        assert "error" not in events[-1] and events[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
