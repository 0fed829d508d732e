"""AsyncEngine: the engine stepped by a background thread; requests stream RequestOutputs to asyncio."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from serve.engine import LLMEngine
from serve.outputs import RequestOutput
from serve.sampling_params import SamplingParams


class AsyncEngine:
    """Thread-safe front of an LLMEngine. `add_request` returns an async stream of cumulative
    RequestOutputs (the last one has finished=True); `abort` stops a request and frees its blocks."""

    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
                 on_abort: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step    # called on the engine thread after every step (metrics)
        self.on_abort = on_abort
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Validate and queue; raises ValueError at once for bad input, before any streaming."""
        loop = asyncio.get_running_loop()
        out_queue: asyncio.Queue = asyncio.Queue()
        done = threading.Event()
        result: dict[str, BaseException] = {}
        self._commands.put(("add", (request_id, prompt, params, kwargs, loop, out_queue, done, result)))
        self._wake.set()
        await asyncio.to_thread(done.wait)
        if "error" in result:
            raise result["error"]
        return self._stream(request_id, out_queue)

    async def _stream(self, request_id: str, out_queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.abort(request_id)  # no-op once finished; frees blocks if the consumer went away

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # --- engine thread ----------------------------------------------------------------------------
    def _handle_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                if payload in self.engine.requests:
                    self.engine.abort_request(payload)
                    if self.on_abort:
                        self.on_abort(payload)
                self._streams.pop(payload, None)
                continue
            request_id, prompt, params, kwargs, loop, out_queue, done, result = payload
            try:
                self.engine.add_request(request_id, prompt, params, **kwargs)
                self._streams[request_id] = (loop, out_queue)
            except (ValueError, TypeError) as e:
                result["error"] = e
            finally:
                done.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._handle_commands()
            if not self.engine.has_unfinished_requests():
                if self.on_step:
                    self.on_step(self.engine, [])
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except BaseException as e:  # a crashed step fails its requests loudly, never silently
                self.error = e
                for request_id, (loop, q) in list(self._streams.items()):
                    loop.call_soon_threadsafe(q.put_nowait, RuntimeError(f"engine step failed: {e!r}"))
                    self.engine.abort_request(request_id)
                self._streams.clear()
                continue
            if self.on_step:
                self.on_step(self.engine, outputs)
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is None:
                    continue
                loop, q = target
                loop.call_soon_threadsafe(q.put_nowait, out)
                if out.finished:
                    del self._streams[out.request_id]
