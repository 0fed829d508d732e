"""Shared pieces of the reliability probes: a server with the liveness and limit options, streams
whose inter-chunk gaps are timed in the background (reported in the tally each module prints at its
end; under a loaded CI machine they are no evidence of a stall, so no check bounds them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from serve import EngineArgs
from serve.engine.async_engine import AsyncEngine
from serve.http.app import build_app
from tests.serve_helpers import ENGINE_DEFAULTS
from tests.server_helpers import MODEL_NAME, serve_in_thread, stream_body

ENGINE = dict(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=512)


@contextlib.contextmanager
def reliability_server(
    *, max_request_body_bytes: int | None = None, **engine_options
) -> Iterator[tuple[str, object, AsyncEngine]]:
    """(url, app, engine) of an in-thread server on the tiny model; `engine_options` go to AsyncEngine."""
    engine = AsyncEngine(EngineArgs(**{**ENGINE_DEFAULTS, **ENGINE}), warmup=False, **engine_options)
    app = build_app(engine, model_name=MODEL_NAME, max_queue=64, max_request_body_bytes=max_request_body_bytes)
    with serve_in_thread(app) as url:
        yield url, app, engine


@dataclass
class Stream:
    """One streamed completion as its client saw it."""

    arrivals: list[float] = field(default_factory=list)
    tokens: int = 0
    done: bool = False
    errors: list[dict] = field(default_factory=list)

    @property
    def worst_gap(self) -> float:
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:])), default=0.0)

    @property
    def unharmed(self) -> bool:
        return self.done and not self.errors


async def stream(url: str, max_tokens: int, out: Stream) -> Stream:
    body = stream_body(max_tokens)
    async with (
        httpx.AsyncClient(timeout=300) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as r,
    ):
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out.done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.errors.append(chunk["error"])
                elif chunk["choices"]:
                    out.arrivals.append(time.monotonic())
                out.tokens = (chunk.get("usage") or {}).get("completion_tokens", out.tokens)
    return out


@contextlib.contextmanager
def background_streams(url: str, count: int = 3, max_tokens: int = 300) -> Iterator[list[Stream]]:
    """`count` streams running on a thread of their own while the body runs; joined on exit, once
    they have produced their first chunk before the body starts."""
    streams = [Stream() for _ in range(count)]

    async def run() -> None:
        await asyncio.gather(*(stream(url, max_tokens, s) for s in streams))

    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not all(s.arrivals for s in streams) and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.01)
    yield streams
    thread.join(timeout=300)


def normal_worst_gap(url: str, count: int = 3, max_tokens: int = 300) -> float:
    """The worst inter-chunk gap of `count` streams with nothing else running."""
    with background_streams(url, count, max_tokens) as streams:
        pass
    assert all(s.unharmed for s in streams)
    return max(s.worst_gap for s in streams)


@dataclass
class Tally:
    """What a module's probes saw, printed at its end (benchmarks/RESULTS.md quotes it)."""

    name: str
    probes: int = 0
    server_errors: int = 0  # 5xx answers to probes that should get a 4xx or success
    streams: int = 0
    streams_harmed: int = 0
    longest_stall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def answer(self, status: int) -> int:
        self.probes += 1
        self.server_errors += status >= 500
        return status

    def watch(self, streams: list[Stream], beside: str) -> None:
        """Count streams that ran beside the probe `beside`, and their worst gap."""
        worst = max(s.worst_gap for s in streams)
        self.streams += len(streams)
        self.streams_harmed += sum(not s.unharmed for s in streams)
        self.longest_stall_s = max(self.longest_stall_s, worst)
        self.notes.append(f"worst stream gap beside {beside} {worst:.3f} s")

    def report(self) -> str:
        return (
            f"[reliability {self.name}] probes {self.probes}, 5xx {self.server_errors}, streams {self.streams}, "
            f"harmed {self.streams_harmed}, longest stall {self.longest_stall_s:.3f} s; " + "; ".join(self.notes)
        )
