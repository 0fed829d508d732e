"""AsyncEngine: the serving frontend. Tokenizing, detokenizing and streaming happen here, in the
server's event loop; scheduling and the model run in an engine-core process (vLLM V1's split).

`add_request` checks and queues a request and returns its stream of RequestOutputs; a stream that
is closed before it finishes aborts its request. If the core process dies, every open stream gets
an EngineDeadError, new requests are refused, and (with restart_on_failure) a new core is started.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec

from jaxinfra.loading import load_tokenizer
from jaxinfra.tokenizer import Tokenizer
from serve.config import EngineArgs
from serve.core_client import CoreProcess, EngineDeadError
from serve.core_types import AbortRequests, EngineCoreOutputs, SchedulerStats
from serve.input_processor import InputProcessor, Prompt
from serve.output_processor import OutputProcessor, RequestIteration
from serve.outputs import RequestOutput
from serve.sampling_params import SamplingParams

log = logging.getLogger("jaxinfra.serve")
IterationHook = Callable[[list[RequestIteration], SchedulerStats | None], None]


class AsyncEngine:
    def __init__(
        self,
        args: EngineArgs,
        *,
        tokenizer: Tokenizer | None = None,
        warmup: bool = True,
        restart_on_failure: bool = False,
        on_iteration: IterationHook | None = None,
    ) -> None:
        self.args = args
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(args.tokenizer or args.model)
        self.warmup = warmup
        self.restart_on_failure = restart_on_failure
        self.on_iteration = on_iteration
        self.core = CoreProcess(args, self.tokenizer.eos_token_ids if self.tokenizer else (), warmup)
        self.max_model_len = self.core.info.max_model_len
        self.vocab_size = self.core.info.vocab_size
        self.num_blocks = self.core.info.num_blocks
        self.input_processor = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len, args.seed, args.scheduling_policy
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.streams: dict[str, asyncio.Queue] = {}
        self.stats: SchedulerStats | None = None
        self.error: str | None = None  # why no request is accepted now (the core died, or is restarting)
        self.restarts = 0
        self._calls: dict[int, asyncio.Future] = {}
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._ids = itertools.count()

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    @property
    def healthy(self) -> bool:
        return self.error is None and self.core.alive

    def _ensure_output_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._output_loop())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- requests ---------------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Check and queue a request (ValueError for bad input, EngineDeadError if the core is gone);
        returns the stream of its outputs."""
        if not self.healthy:
            raise EngineDeadError(self.error or "the engine core process is not running")
        if request_id in self.streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        req = self.input_processor.process(
            request_id, prompt, params, cache_salt=cache_salt, prompt_token_ids=prompt_token_ids, priority=priority
        )
        self._ensure_output_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = queue
        self.output_processor.add_request(
            request_id, prompt if isinstance(prompt, str) else None, req.prompt_token_ids, params, req.arrival_time
        )
        try:
            await self.core.send(req)
        except BaseException:
            self.streams.pop(request_id, None)
            self.output_processor.abort(request_id)
            raise
        return self._stream(request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)  # the consumer went away: free its blocks now

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (unknown or finished ids are ignored)."""
        self.streams.pop(request_id, None)
        aborted = self.output_processor.abort(request_id)
        if aborted is None:
            return
        if self.on_iteration:
            self.on_iteration([aborted[1]], None)
        if self.healthy:
            self._spawn(self.core.send(AbortRequests([request_id])))

    async def call(self, method: str, *args: Any) -> Any:
        """A utility call on the core ("stats", "check_invariants", "reset_prefix_cache")."""
        if not self.healthy:
            raise EngineDeadError(self.error or "the engine core process is not running")
        self._ensure_output_loop()
        msg = self.core.new_call(method, list(args))
        future = asyncio.get_running_loop().create_future()
        self._calls[msg.call_id] = future
        await self.core.send(msg)
        result = await future
        return msgspec.convert(result, SchedulerStats) if method == "stats" else result

    # --- outputs ----------------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            while True:
                self._handle(await self.core.recv())
        except EngineDeadError as e:
            log.error("engine core died: %s", e)
            self._fail_all(str(e))
            if self.restart_on_failure:
                await self._restart()

    def _handle(self, msg: EngineCoreOutputs) -> None:
        if msg.utility is not None:
            call_id, error, result = msg.utility
            future = self._calls.pop(call_id, None)
            if future is not None and not future.done():
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(RuntimeError(error))
        for rid, why in msg.rejected:
            queue = self.streams.pop(rid, None)
            self.output_processor.abort(rid)
            if queue is not None:
                queue.put_nowait(ValueError(why))
        processed = self.output_processor.process(msg.outputs)
        for out in processed.outputs:
            queue = self.streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
                if out.finished:
                    del self.streams[out.request_id]
        if processed.to_abort:
            self._spawn(self.core.send(AbortRequests([], processed.to_abort)))
        if msg.stats is not None:
            self.stats = msg.stats
        if self.on_iteration:
            self.on_iteration(processed.iterations, msg.stats)

    def _fail_all(self, reason: str) -> None:
        """The core is gone: every open stream ends with an error, every request is dropped."""
        self.error = reason
        iterations = []
        for rid, queue in list(self.streams.items()):
            queue.put_nowait(EngineDeadError(reason))
            aborted = self.output_processor.abort(rid)
            if aborted is not None:
                iterations.append(aborted[1])
        self.streams.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._calls.clear()
        if self.on_iteration and iterations:
            self.on_iteration(iterations, None)

    async def _restart(self) -> None:
        """Start a new core process (the supervisor option); requests are refused until it is ready."""
        self.error = "the engine core is restarting"
        self.core.close()
        try:
            self.core = await asyncio.to_thread(
                CoreProcess, self.args, self.tokenizer.eos_token_ids if self.tokenizer else (), self.warmup
            )
        except Exception as e:
            self.error = f"the engine core could not be restarted: {e}"
            return
        self.restarts += 1
        self.error = None
        log.warning("engine core restarted (%d so far)", self.restarts)
        self._task = asyncio.get_running_loop().create_task(self._output_loop())

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.core.close()
