"""Drive Debian's headless Chromium over the Chrome DevTools protocol (a websocket on loopback):
open a page with extra request headers, evaluate JavaScript in it, take a screenshot."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class Page:
    """One browser tab: `call` sends a DevTools command and returns its result."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self._ids = itertools.count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """Evaluate `expression` until it is truthy (errors count as not yet: the page may still be
        loading); returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError as e:
                value, error = None, e
            else:
                error = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression!r} stayed falsy for {timeout} s (last error: {error})")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))


@contextlib.contextmanager
def open_page(url: str, headers: dict[str, str] | None = None, size: tuple[int, int] = (1280, 1400)) -> Iterator[Page]:
    """Start headless Chromium, open `url` (every request carrying `headers`), yield the page."""
    binary = chromium_path()
    if binary is None:
        raise FileNotFoundError("no chromium binary (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                f"--window-size={size[0]},{size[1]}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 30
            while not port_file.exists() or not port_file.read_text().strip():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("chromium did not start its DevTools endpoint")
                time.sleep(0.05)
            port = int(port_file.read_text().split()[0])
            target = next(t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page")
            with connect(target["webSocketDebuggerUrl"], max_size=2**26) as ws:
                page = Page(ws)
                page.call("Network.enable")
                if headers:
                    page.call("Network.setExtraHTTPHeaders", headers=headers)
                page.call("Page.enable")
                page.call("Page.navigate", url=url)
                yield page
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
