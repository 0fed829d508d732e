"""The frontend's handle on an engine-core process: spawn it, talk to it over one channel (a pipe each
way, serve.core.transport: requests, aborts and utility calls in; ready, outputs and heartbeats out),
and watch it: the process's exit and its heartbeats (sent by a thread of its own, so a long step is
not silence, but a stopped or wedged process is)."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from serve.config import EngineArgs
from serve.core.core_proc import ALLOCATOR_ENV
from serve.core.kv_budget import core_process_env
from serve.core.transport import AsyncFrameWriter, FrameReader, Kind, TornFrameError, encode, open_pipe
from serve.types import (
    AbortRequests,
    CoreLaunch,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    StartupError,
    UtilityCall,
)

STARTUP_TIMEOUT_S = 1800.0  # loading and compiling a big model can take long; death is noticed at once
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
WATCH_INTERVAL_S = 0.1  # how often the process and its heartbeats are checked


POOL_SIZE_ENV = ("PJRT_NPROC", "NPROC")  # XLA's CPU client sizes its thread pools from the first set


def xla_pool_env(args: EngineArgs) -> dict[str, str]:
    """PJRT_NPROC for the core process: every core but EngineArgs.cpu_reserved_cores (at least one),
    unless the environment already sizes XLA's pools. With every core in XLA's pool, its threads hand
    each decode step between them and the frontend's threads wait for a core: on 2 cores, one thread
    made one-sequence steps as fast, and the gaps over 1.9 ms between a stream's tokens fell from 9%
    to 2%."""
    if not args.cpu_reserved_cores or any(os.environ.get(k) for k in POOL_SIZE_ENV):
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"PJRT_NPROC": str(max(1, cores - args.cpu_reserved_cores))}


class EngineDeadError(RuntimeError):
    """The engine-core process is gone: what was in flight failed, nothing new is accepted."""


class CoreHandle(Protocol):
    """What the frontend (AsyncEngine) needs of an engine core: CoreProcess is the one that serves; a
    stand-in of this shape lets the HTTP layer be tested without a model."""

    info: EngineCoreReady
    last_beat: float | None

    @property
    def alive(self) -> bool: ...

    @property
    def closed(self) -> bool: ...

    def trouble(self) -> str | None: ...

    async def watch(self) -> str: ...

    async def send(self, msg: EngineCoreRequest | AbortRequests | UtilityCall) -> None: ...

    async def recv(self) -> EngineCoreOutputs: ...

    def new_call(self, method: str, args: list[Any]) -> UtilityCall: ...

    def kill(self) -> None: ...

    def close(self, timeout: float = 5.0) -> None: ...


# (args, eos_token_ids, warmup, heartbeat_timeout) -> a started core; CoreProcess itself
CoreFactory = Callable[[EngineArgs, tuple[int, ...], bool, float], CoreHandle]


class CoreProcess:
    """One engine-core process (a fresh interpreter, so no caller's __main__ is re-run) and its channel:
    an input pipe and an output pipe, which inherits nothing a killed frontend could leave behind.
    Construction blocks until the core is loaded and warmed up, or raises with the reason it could not
    start."""

    def __init__(
        self,
        args: EngineArgs,
        eos_token_ids: tuple[int, ...],
        warmup: bool = True,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    ) -> None:
        """`heartbeat_timeout`: seconds of silence, once the core has beaten, after which it is stuck."""
        self.heartbeat_timeout = heartbeat_timeout
        self._closed = False
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._calls = itertools.count()
        in_r, in_w = open_pipe()
        out_r, out_w = open_pipe()
        self._input = AsyncFrameWriter(in_w)
        self._outputs = FrameReader(out_r)
        self._beats_heard = 0
        self.last_beat: float | None = None  # monotonic time the last heartbeat was noticed
        launch = CoreLaunch(args, list(eos_token_ids), warmup, in_r, out_w, os.getpid())
        env = {**ALLOCATOR_ENV, **core_process_env(args), **xla_pool_env(args), **os.environ}  # the caller's win
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from serve.core.core_proc import main; main()"],
            stdin=subprocess.PIPE,
            env=env,
            pass_fds=(in_r, out_w),
        )
        for fd in (in_r, out_w):
            os.close(fd)
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.msgpack.encode(launch))
        self.proc.stdin.close()
        self.info = self._wait_ready()

    def _wait_ready(self) -> EngineCoreReady:
        """The core's first frame past its heartbeats: READY, or STARTUP_ERROR (a ValueError here)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                if self._outputs.wait(WATCH_INTERVAL_S):
                    frames = self._outputs.take()
                    break
            except EOFError:
                self.close()
                raise RuntimeError(f"the engine core died while starting (exit code {self.proc.wait()})") from None
            trouble = self.trouble()
            if trouble is None and time.monotonic() > deadline:
                trouble = f"the engine core did not start within {STARTUP_TIMEOUT_S:g} s"
            if trouble is not None:
                self.close()
                raise RuntimeError(f"{trouble} while starting")
        kind, payload = frames[0]
        if kind is Kind.STARTUP_ERROR:
            self.close()
            raise ValueError(msgspec.msgpack.decode(payload, type=StartupError).message)
        if kind is not Kind.READY or len(frames) > 1:
            self.close()
            raise RuntimeError(f"unexpected {kind.name} frame from the engine core while starting")
        return msgspec.msgpack.decode(payload, type=EngineCoreReady)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def trouble(self) -> str | None:
        """Why this core is lost (exited, or silent for heartbeat_timeout s after its first beat:
        then it is killed), or None while it is fine. Reads what has arrived, to hear its heartbeats."""
        if not self.alive:
            return f"the engine core process exited (code {self.proc.returncode})"
        now = time.monotonic()
        if not self._outputs.closed:
            self._outputs.pump()
        if self._outputs.heartbeats != self._beats_heard:
            self._beats_heard = self._outputs.heartbeats
            self.last_beat = now
        if self.last_beat is not None and now - self.last_beat > self.heartbeat_timeout:
            self.kill()
            return (
                f"the engine core stopped answering: no heartbeat for {now - self.last_beat:.1f} s "
                f"(--engine-heartbeat-timeout {self.heartbeat_timeout:g}); it was killed"
            )
        return None

    async def watch(self) -> str:
        """Return, with the reason, once the core is lost (see trouble); checked every WATCH_INTERVAL_S."""
        self.last_beat = time.monotonic()  # its first full timeout starts now
        while (trouble := self.trouble()) is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
        return trouble

    async def send(self, msg: EngineCoreRequest | AbortRequests | UtilityCall) -> None:
        """Queue a message for the core; EngineDeadError if it is gone, or goes while this waits."""
        if not self.alive or self.closed:
            raise EngineDeadError("the engine core process is not running")
        try:
            await self._input.write(*encode(msg))
        except BrokenPipeError:  # it closed its end: it is exiting
            raise EngineDeadError("the engine core went away") from None
        except asyncio.CancelledError:
            if self.closed:  # close() cancels what waits on its pipe
                raise EngineDeadError("the engine core went away") from None
            raise

    async def recv(self) -> EngineCoreOutputs:
        """The next message from the core (the watcher, not this, notices when it is gone)."""
        try:
            kind, payload = await self._outputs.read()
        except TornFrameError as e:  # it died writing a frame: the watcher reports how it ended
            print(f"engine core: {e}", file=sys.stderr)
            await asyncio.Event().wait()  # never set: cancelled with its task
            raise
        if kind is not Kind.OUTPUTS:
            raise RuntimeError(f"unexpected message from the engine core: {kind.name}")
        return self._decoder.decode(payload)

    def new_call(self, method: str, args: list[Any]) -> UtilityCall:
        return UtilityCall(next(self._calls), method, args)

    def kill(self) -> None:
        """SIGKILL: the way to end a core that is stopped or wedged (SIGTERM waits for it to run)."""
        if self.alive:
            self.proc.kill()
            self.proc.wait()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float = 5.0) -> None:
        """Stop the core process (it holds no state worth saving), cancel what waits on its pipes, and
        close them."""
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if not self._closed:
            self._input.close()
            self._outputs.close()
            self._closed = True
