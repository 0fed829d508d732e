"""AsyncEngine: the serving frontend. Tokenizing, detokenizing and streaming happen here, in the
server's event loop; scheduling and the model run in an engine-core process (vLLM V1's split).

`add_request` checks and queues a request and returns its stream of RequestOutputs; a stream that
is closed before it finishes aborts its request. A supervisor task (`start`) watches the core from
the moment the server runs, requests or not: if the process exits or its heartbeats stop for
`heartbeat_timeout` s, every open stream gets an EngineDeadError, new requests are refused (503),
the scheduler gauges drop to zero, and with restart_on_failure a new core is started, with back-off;
after `restart_attempts` failed starts in a row the engine is fatal (on_fatal: the server exits
non-zero so that its own supervisor takes over).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec

from jaxinfra.loading import load_tokenizer
from jaxinfra.tokenizer import Tokenizer
from serve.config import EngineArgs
from serve.engine.core_client import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    CoreFactory,
    CoreHandle,
    CoreProcess,
    EngineDeadError,
)
from serve.engine.grammar_check import GrammarChecker
from serve.engine.input_processor import InputProcessor, Prompt
from serve.engine.output_processor import OutputProcessor, RequestIteration
from serve.sampling_params import SamplingParams
from serve.types import AbortRequests, EngineCoreOutputs, LoRARequest, RequestOutput, SchedulerStats

log = logging.getLogger("jaxinfra.serve")
IterationHook = Callable[[list[RequestIteration], SchedulerStats | None], None]
DEFAULT_RESTART_ATTEMPTS = 5
RESTART_BACKOFF_S = 1.0  # before the second attempt; doubled after each failure, up to the max
MAX_RESTART_BACKOFF_S = 16.0
NO_CORE_STATS = SchedulerStats(
    num_running=0,
    num_waiting=0,
    kv_cache_usage=0.0,
    prefix_cache_queries=0,
    prefix_cache_hits=0,
    num_preemptions=0,
    num_free_blocks=0,
    num_blocks=0,
    num_compilations=0,
)  # what the gauges show while no core runs


class AsyncEngine:
    def __init__(
        self,
        args: EngineArgs,
        *,
        tokenizer: Tokenizer | None = None,
        warmup: bool = True,
        restart_on_failure: bool = False,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        restart_attempts: int = DEFAULT_RESTART_ATTEMPTS,
        on_iteration: IterationHook | None = None,
        on_fatal: Callable[[str], None] | None = None,
        core_factory: CoreFactory = CoreProcess,
    ) -> None:
        """`heartbeat_timeout`: seconds of heartbeat silence after which the core counts as stuck;
        `restart_attempts`: failed starts in a row before giving up; `on_fatal(reason)`: called then;
        `core_factory`: what starts a core (and each restart's): a CoreProcess unless a test says otherwise."""
        if heartbeat_timeout <= 0:
            raise ValueError(f"heartbeat_timeout must be positive, got {heartbeat_timeout!r}")
        if restart_attempts < 1:
            raise ValueError(f"restart_attempts must be at least 1, got {restart_attempts!r}")
        self.args = args
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(args.tokenizer or args.model)
        self.warmup = warmup
        self.restart_on_failure = restart_on_failure
        self.heartbeat_timeout = heartbeat_timeout
        self.restart_attempts = restart_attempts
        self.on_iteration = on_iteration
        self.on_fatal = on_fatal
        self.core_factory = core_factory
        self._shut_down = False
        self.core = self._new_core()
        self.max_model_len = self.core.info.max_model_len
        self.vocab_size = self.core.info.vocab_size
        self.num_blocks = self.core.info.num_blocks
        self.input_processor = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len, args.seed, args.scheduling_policy
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._grammar_checker: GrammarChecker | None = None
        self.streams: dict[str, asyncio.Queue] = {}
        self.stats: SchedulerStats | None = None
        self.error: str | None = None  # why no request is accepted now (the core died, or is restarting)
        self.fatal: str | None = None  # set when restarting has failed for good
        self.restarts = 0
        self._calls: dict[int, asyncio.Future] = {}
        self._supervisor: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._ids = itertools.count()

    @property
    def grammar_checker(self) -> GrammarChecker:
        """Where structured-output constraints are checked (a ValueError if this engine has no tokenizer)."""
        if self._grammar_checker is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer, and this engine has none")
            self._grammar_checker = GrammarChecker(self.tokenizer, self.vocab_size, self.tokenizer.eos_token_ids)
        return self._grammar_checker

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    @property
    def healthy(self) -> bool:
        return self.error is None and self.core.alive

    def _new_core(self) -> CoreHandle:
        eos = self.tokenizer.eos_token_ids if self.tokenizer else ()
        core = self.core_factory(self.args, tuple(eos), self.warmup, self.heartbeat_timeout)
        if self._shut_down:  # shut down while this one started (on a restart's thread)
            core.close()
            raise EngineDeadError("the engine was shut down")
        return core

    def start(self) -> None:
        """Start supervising the core (reading its outputs, watching it); call it in the server's
        event loop as the server starts. Idempotent: requests call it too."""
        if self._supervisor is None:
            self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    def _send_later(self, msg: AbortRequests) -> None:
        """Send from a background task (aborts: nobody waits for them, a dead core needs none)."""

        async def send() -> None:
            with contextlib.suppress(EngineDeadError):
                await self.core.send(msg)

        task = asyncio.get_running_loop().create_task(send())
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
        kv_transfer_params: dict[str, Any] | None = None,
        tenant: str = "",
        weight: float = 1.0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Check and queue a request (ValueError for bad input, EngineDeadError if the core is gone);
        returns the stream of its outputs. `lora_request`: the adapter it runs with (None: the base model)."""
        if not self.healthy:
            raise EngineDeadError(self.error or "the engine core process is not running")
        if request_id in self.streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.structured_outputs is not None:
            await self.grammar_checker.check(params.structured_outputs)  # in a child process: see grammar_check
        req = self.input_processor.process(
            request_id,
            prompt,
            params,
            cache_salt=cache_salt,
            prompt_token_ids=prompt_token_ids,
            priority=priority,
            kv_transfer_params=kv_transfer_params,
            grammar_checked=params.structured_outputs is not None,
            tenant=tenant,
            weight=weight,
            lora_request=lora_request,
        )
        self.start()
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
            self._send_later(AbortRequests([request_id]))

    async def call(self, method: str, *args: Any) -> Any:
        """A utility call on the core ("stats", "check_invariants", "reset_prefix_cache", "add_lora", ...)."""
        if not self.healthy:
            raise EngineDeadError(self.error or "the engine core process is not running")
        self.start()
        msg = self.core.new_call(method, list(args))
        future = asyncio.get_running_loop().create_future()
        self._calls[msg.call_id] = future
        await self.core.send(msg)
        result = await future
        return msgspec.convert(result, SchedulerStats) if method == "stats" else result

    # --- supervision ------------------------------------------------------------------------------
    async def _supervise(self) -> None:
        """Read the core's outputs and watch it; when it is lost, fail what it held and, with
        restart_on_failure, start another (until restarting fails for good)."""
        while True:
            outputs = asyncio.create_task(self._output_loop())
            watch = asyncio.create_task(self.core.watch())
            await asyncio.wait({outputs, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done():
                why = watch.result()
            else:  # a bug in handling outputs: the core's state is unknown, so it goes too
                why = f"reading the engine core's outputs failed: {outputs.exception()!r}"
                watch.cancel()
                self.core.kill()
            outputs.cancel()
            log.error("engine core lost: %s", why)
            self._fail_all(why)
            self.core.close()  # what still waits to be sent to it fails too
            if not self.restart_on_failure or not await self._restart():
                return

    async def _restart(self) -> bool:
        """Start a new core process, retrying with back-off; False (and fatal) once
        restart_attempts starts in a row have failed. Requests are refused until it is ready."""
        last: Exception | None = None
        for attempt in range(1, self.restart_attempts + 1):
            self.error = f"the engine core is restarting (attempt {attempt} of {self.restart_attempts})"
            try:
                self.core = await asyncio.to_thread(self._new_core)
            except Exception as e:
                log.error("engine core restart attempt %d of %d failed: %s", attempt, self.restart_attempts, e)
                last = e
                if attempt < self.restart_attempts:
                    await asyncio.sleep(min(RESTART_BACKOFF_S * 2 ** (attempt - 1), MAX_RESTART_BACKOFF_S))
                continue
            self.restarts += 1
            self.error = None
            log.warning("engine core restarted (%d so far)", self.restarts)
            return True
        self._give_up(f"the engine core could not be restarted: {self.restart_attempts} attempts failed; last: {last}")
        return False

    def _give_up(self, reason: str) -> None:
        self.error = self.fatal = reason
        log.critical("FATAL: %s; giving up so that a supervisor can take over", reason)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    # --- outputs ----------------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            self._handle(await self.core.recv())

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
            self._send_later(AbortRequests([], processed.to_abort))
        if msg.stats is not None:
            self.stats = msg.stats
        if self.on_iteration:
            self.on_iteration(processed.iterations, msg.stats)

    def _fail_all(self, reason: str) -> None:
        """The core is gone: every open stream ends with an error, every request is dropped, and
        the scheduler gauges drop to zero."""
        self.error = reason
        self.stats = None
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
        if self.on_iteration:
            self.on_iteration(iterations, NO_CORE_STATS)

    def shutdown(self) -> None:
        self._shut_down = True
        if self._grammar_checker is not None:
            self._grammar_checker.close()
        if self._supervisor is not None:
            self._supervisor.cancel()
        self.core.close()
