"""A flood of small completions from one API key, as fast as `--connections` clients can send them, until a
stop file appears (or its own time and count limits): the load of benchmarks/tenant_flood.py's tenant A.
Imports only httpx, so starting it takes no CPU from the server being measured.

    python -m benchmarks.flood_client URL MODEL KEY STOP_FILE [--connections 16]
    python -m benchmarks.flood_client --stub PORT   # a server that answers every request 429, for a control

Prints "ready" after its first answer, then one JSON line: how many answers of each status.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx

LIMIT_S = 120.0  # the flood ends by itself after this long, or after LIMIT_REQUESTS
LIMIT_REQUESTS = 100_000


async def flood(url: str, model: str, key: str, connections: int, stop_file: Path) -> Counter[int]:
    statuses: Counter[int] = Counter()
    body = {"model": model, "prompt": "flood", "max_tokens": 4}
    deadline = time.monotonic() + LIMIT_S
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=connections)) as client:

        async def one_client() -> None:
            while not stop_file.exists() and time.monotonic() < deadline and statuses.total() < LIMIT_REQUESTS:
                try:
                    statuses[(await client.post(f"{url}/v1/completions", json=body, headers=headers)).status_code] += 1
                except httpx.HTTPError:
                    statuses[0] += 1
                if statuses.total() == 1:
                    print("ready", flush=True)

        await asyncio.gather(*(one_client() for _ in range(connections)))
    return statuses


async def refuse_all(scope: dict, receive: Callable, send: Callable) -> None:
    """An ASGI app that answers every HTTP request 429 without reading its body: the control's target."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 429, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"error": {"message": "refused"}}'})


def exit_with_parent(parent: int) -> None:
    """The stub server ends when the benchmark that started it is gone, however it ended."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", nargs="?")
    p.add_argument("model", nargs="?")
    p.add_argument("key", nargs="?")
    p.add_argument("stop_file", nargs="?", type=Path)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--stub", type=int, metavar="PORT", help="serve the control's refuse-all server instead")
    a = p.parse_args()
    if a.stub:
        import uvicorn

        threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()
        uvicorn.run(refuse_all, host="127.0.0.1", port=a.stub, log_level="error")
        return
    print(json.dumps(asyncio.run(flood(a.url, a.model, a.key, a.connections, a.stop_file))), flush=True)


if __name__ == "__main__":
    main()
