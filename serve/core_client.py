"""The frontend's handle on an engine-core process: spawn it, talk to it over ZeroMQ, notice death."""

from __future__ import annotations

import itertools
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from serve.config import EngineArgs
from serve.core_proc import ALLOCATOR_ENV
from serve.core_types import (
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
LIVENESS_POLL_MS = 200


class EngineDeadError(RuntimeError):
    """The engine-core process is gone: what was in flight failed, nothing new is accepted."""


class CoreProcess:
    """One engine-core process (a fresh interpreter, so no caller's __main__ is re-run) and
    the two sockets to it. Construction blocks until the core is loaded and warmed up, or raises
    with the reason it could not start."""

    def __init__(self, args: EngineArgs, eos_token_ids: tuple[int, ...], warmup: bool = True) -> None:
        self.dir = tempfile.mkdtemp(prefix="jaxinfra-core-")
        self.input_addr, self.output_addr = f"ipc://{self.dir}/input", f"ipc://{self.dir}/output"
        self._sockets: tuple[zmq.asyncio.Socket, zmq.asyncio.Socket] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreOutput)
        self._calls = itertools.count()
        ready_r, ready_w = os.pipe()
        launch = CoreLaunch(args, list(eos_token_ids), warmup, self.input_addr, self.output_addr, ready_w)
        env = {**ALLOCATOR_ENV, **os.environ}  # the caller's settings win
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from serve.core_proc import main; main()"],
            stdin=subprocess.PIPE,
            env=env,
            pass_fds=(ready_w,),
        )
        os.close(ready_w)
        assert self.proc.stdin is not None
        self.proc.stdin.write(self._encoder.encode(launch))
        self.proc.stdin.close()
        with os.fdopen(ready_r, "rb") as ready:
            self.info = self._wait_ready(ready)

    def _wait_ready(self, ready) -> EngineCoreReady:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not select.select([ready], [], [], 0.2)[0]:
            if not self.alive or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the engine core did not start (exit code {self.proc.returncode})")
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

    def _socks(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        """Created on first use, in the event loop that uses them."""
        if self._sockets is None:
            ctx = zmq.asyncio.Context.instance()
            push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
            push.bind(self.input_addr)
            pull.bind(self.output_addr)
            self._sockets = push, pull
        return self._sockets

    async def send(self, msg: EngineCoreRequest | AbortRequests | UtilityCall) -> None:
        if not self.alive:
            raise EngineDeadError("the engine core process is not running")
        await self._socks()[0].send(self._encoder.encode(msg))

    async def recv(self) -> EngineCoreOutputs:
        """The next message from the core; EngineDeadError once the process has ended."""
        pull = self._socks()[1]
        while not await pull.poll(LIVENESS_POLL_MS):
            if not self.alive:
                raise EngineDeadError(f"the engine core process exited (code {self.proc.returncode})")
        msg = self._decoder.decode(await pull.recv())
        if not isinstance(msg, EngineCoreOutputs):
            raise RuntimeError(f"unexpected message from the engine core: {type(msg).__name__}")
        return msg

    def new_call(self, method: str, args: list[Any]) -> UtilityCall:
        return UtilityCall(next(self._calls), method, args)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the core process (it holds no state worth saving) and remove its sockets."""
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self._sockets is not None:
            for sock in self._sockets:
                sock.close(linger=0)
            self._sockets = None
        shutil.rmtree(self.dir, ignore_errors=True)
