"""The frontend's handle on an engine-core process: spawn it, send it requests over ZeroMQ, read its
outputs from a pipe, and watch it: the process's exit and its heartbeat pipe (beaten by a thread of
its own, so a long step is not silence, but a stopped or wedged process is)."""

from __future__ import annotations

import asyncio
import itertools
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from serve.config import EngineArgs
from serve.core.core_proc import ALLOCATOR_ENV
from serve.core.kv_budget import core_process_env
from serve.core.output_pipe import FrameReader, open_output_pipe
from serve.core.pids import creator_gone
from serve.types import (
    AbortRequests,
    CoreLaunch,
    CoreOutput,
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


SOCKET_DIR_PREFIX = "jaxinfra-core-"  # + the frontend's pid: a killed frontend's folder is swept later


def remove_stale_socket_dirs(root: str | None = None) -> None:
    """Remove socket folders of frontends that are gone (killed before they could clean up)."""
    for path in Path(root or tempfile.gettempdir()).glob(f"{SOCKET_DIR_PREFIX}*-*"):
        if creator_gone(path.name, SOCKET_DIR_PREFIX):
            shutil.rmtree(path, ignore_errors=True)


class EngineDeadError(RuntimeError):
    """The engine-core process is gone: what was in flight failed, nothing new is accepted."""


class CoreProcess:
    """One engine-core process (a fresh interpreter, so no caller's __main__ is re-run), its input
    socket, its output pipe and its heartbeat pipe. Construction blocks until the core is loaded and
    warmed up, or raises with the reason it could not start."""

    def __init__(
        self,
        args: EngineArgs,
        eos_token_ids: tuple[int, ...],
        warmup: bool = True,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    ) -> None:
        """`heartbeat_timeout`: seconds of silence, once the core has beaten, after which it is stuck."""
        self.heartbeat_timeout = heartbeat_timeout
        remove_stale_socket_dirs()
        self.dir: str | None = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
        self.input_addr = f"ipc://{self.dir}/input"
        self._input: zmq.asyncio.Socket | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreOutput)
        self._calls = itertools.count()
        out_r, out_w = open_output_pipe()
        self._outputs = FrameReader(out_r)
        ready_r, ready_w = os.pipe()
        self._heartbeat, beat_w = os.pipe()
        os.set_blocking(self._heartbeat, False)
        self.last_beat: float | None = None  # monotonic time of the last heartbeat heard
        launch = CoreLaunch(args, list(eos_token_ids), warmup, self.input_addr, out_w, ready_w, beat_w, os.getpid())
        env = {**ALLOCATOR_ENV, **core_process_env(args), **xla_pool_env(args), **os.environ}  # the caller's win
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from serve.core.core_proc import main; main()"],
            stdin=subprocess.PIPE,
            env=env,
            pass_fds=(out_w, ready_w, beat_w),
        )
        for fd in (out_w, ready_w, beat_w):
            os.close(fd)
        assert self.proc.stdin is not None
        self.proc.stdin.write(self._encoder.encode(launch))
        self.proc.stdin.close()
        with os.fdopen(ready_r, "rb") as ready:
            self.info = self._wait_ready(ready)

    def _wait_ready(self, ready) -> EngineCoreReady:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not select.select([ready], [], [], WATCH_INTERVAL_S)[0]:
            trouble = self.trouble()
            if trouble is None and time.monotonic() > deadline:
                trouble = f"the engine core did not start within {STARTUP_TIMEOUT_S:g} s"
            if trouble is not None:
                self.close()
                raise RuntimeError(f"{trouble} while starting")
        data = ready.read()
        if not data:
            self.close()
            raise RuntimeError(f"the engine core died while starting (exit code {self.proc.wait()})")
        msg = msgspec.msgpack.decode(data, type=EngineCoreReady | StartupError)
        if isinstance(msg, StartupError):
            self.close()
            raise ValueError(msg.message)
        return msg

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def trouble(self) -> str | None:
        """Why this core is lost (exited, or silent for heartbeat_timeout s after its first beat:
        then it is killed), or None while it is fine. Reads the heartbeats that have arrived."""
        if not self.alive:
            return f"the engine core process exited (code {self.proc.returncode})"
        now = time.monotonic()
        try:
            if os.read(self._heartbeat, 1 << 16):
                self.last_beat = now
        except BlockingIOError:
            pass
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

    def _socket(self) -> zmq.asyncio.Socket:
        """Created on first use, in the event loop that uses it."""
        if self._input is None:
            self._input = zmq.asyncio.Context.instance().socket(zmq.PUSH)
            self._input.bind(self.input_addr)
        return self._input

    async def send(self, msg: EngineCoreRequest | AbortRequests | UtilityCall) -> None:
        """Queue a message for the core; EngineDeadError if it is gone, or goes while this waits."""
        if not self.alive or self.closed:
            raise EngineDeadError("the engine core process is not running")
        try:
            await self._socket().send(self._encoder.encode(msg))
        except asyncio.CancelledError:
            if self.closed:  # close() cancels what waits on its socket
                raise EngineDeadError("the engine core went away") from None
            raise

    async def recv(self) -> EngineCoreOutputs:
        """The next message from the core (the watcher, not this, notices when it is gone)."""
        msg = self._decoder.decode(await self._outputs.read())
        if not isinstance(msg, EngineCoreOutputs):
            raise RuntimeError(f"unexpected message from the engine core: {type(msg).__name__}")
        return msg

    def new_call(self, method: str, args: list[Any]) -> UtilityCall:
        return UtilityCall(next(self._calls), method, args)

    def kill(self) -> None:
        """SIGKILL: the way to end a core that is stopped or wedged (SIGTERM waits for it to run)."""
        if self.alive:
            self.proc.kill()
            self.proc.wait()

    @property
    def closed(self) -> bool:
        return self.dir is None

    def close(self, timeout: float = 5.0) -> None:
        """Stop the core process (it holds no state worth saving), cancel what waits on its socket
        and pipe, and remove them."""
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._input is not None:
            self._input.close(linger=0)
            self._input = None
        if self.dir is not None:
            self._outputs.close()
            os.close(self._heartbeat)
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
