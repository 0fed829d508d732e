"""Structured-output constraints checked in a child process before a request reaches the engine core.

llguidance validates a grammar in native code: a Lark grammar of 3,000 chained rules overflows its
stack (a segfault), and a 2,000-branch `anyOf` schema takes a second of CPU. Run on the server's event
loop, the first killed the whole server and the second stalled every stream. Here the check runs in a
child process with a time budget: a crash or a timeout costs only that request (a 400) and a new child.
The child checks on a thread whose stack is smaller than the engine core's grammar threads', so what
passes here also builds there. Constraints that passed are remembered, so n prompts of one request (or a
client's repeated schema) are checked once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import struct
import sys
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, BinaryIO

import msgspec

from serve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # the child imports this module: it stays clear of jax
    from jaxinfra.tokenizer import Tokenizer

MAX_CONSTRAINT_BYTES = 128 * 1024  # a constraint's msgpack size; larger ones are refused unchecked
CHECK_BUDGET_S = 5.0  # one check, in the child; past it the child is killed and the request refused
CHILD_START_S = 120.0  # a new child importing llguidance and loading the tokenizer
CHECKER_STACK_BYTES = 4 << 20  # the core's grammar threads get the platform's default (8 MiB on Linux)
REMEMBERED = 256  # constraints that passed, kept to skip checking them again
HEADER = struct.Struct("<I")
PR_SET_PDEATHSIG = 1


class GrammarChecker:
    """Checks constraints for one tokenizer in a child process started on first use (and again after
    one crashed or ran past its budget). One check at a time; `check` never blocks the event loop."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], budget_s: float = CHECK_BUDGET_S
    ) -> None:
        eos = list(eos_token_ids or tokenizer.eos_token_ids)
        self._launch = msgspec.msgpack.encode([tokenizer.tok.to_str(), vocab_size, eos])
        self.budget_s = budget_s
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._passed: OrderedDict[bytes, None] = OrderedDict()

    async def check(self, so: StructuredOutputsParams) -> None:
        """Return if the constraint is valid; ValueError naming structured_outputs and why if not."""
        key = msgspec.msgpack.encode(so)
        if len(key) > MAX_CONSTRAINT_BYTES:
            raise ValueError(
                f"structured_outputs: the constraint takes {len(key)} bytes, more than the {MAX_CONSTRAINT_BYTES} "
                "this server checks"
            )
        if key in self._passed:
            self._passed.move_to_end(key)
            return
        async with self._lock:
            error = await self._ask(key)
        if error is not None:
            raise ValueError(error if error.startswith("structured_outputs") else f"structured_outputs: {error}")
        self._passed[key] = None
        if len(self._passed) > REMEMBERED:
            self._passed.popitem(last=False)

    async def _ask(self, key: bytes) -> str | None:
        try:
            proc = await self._child()
            assert proc.stdin is not None
            async with asyncio.timeout(self.budget_s):
                proc.stdin.write(HEADER.pack(len(key)) + key)
                await proc.stdin.drain()
                return await _reply(proc)
        except TimeoutError:
            self.close()
            return f"the grammar was not checked within {self.budget_s:g} s"
        except (asyncio.IncompleteReadError, ConnectionError):
            code = await self._proc.wait() if self._proc is not None else None
            self._proc = None
            return f"checking the grammar crashed its checker (exit {code}): is it nested too deeply?"

    async def _child(self) -> asyncio.subprocess.Process:
        """The running child, or a new one once it has loaded the tokenizer (its start is not part of
        a check's budget)."""
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                "from serve.engine.grammar_check import main; main()",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            assert self._proc.stdin is not None
            self._proc.stdin.write(HEADER.pack(len(self._launch)) + self._launch)
            try:
                await asyncio.wait_for(_reply(self._proc), CHILD_START_S)
            except TimeoutError as e:
                self.close()
                raise ValueError(
                    f"structured_outputs: the grammar checker did not start within {CHILD_START_S} s"
                ) from e
        return self._proc

    def close(self) -> None:
        """Kill the child (a new one starts with the next check)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()


async def _reply(proc: asyncio.subprocess.Process) -> str | None:
    """The child's next reply frame (IncompleteReadError if it died)."""
    assert proc.stdout is not None
    (size,) = HEADER.unpack(await proc.stdout.readexactly(HEADER.size))
    return msgspec.msgpack.decode(await proc.stdout.readexactly(size), type=str | None)


def _write_frame(stream: BinaryIO, value: str | None) -> None:
    data = msgspec.msgpack.encode(value)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def _read_frame(stream: BinaryIO) -> bytes | None:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None  # the server closed our stdin: it is gone
    return stream.read(HEADER.unpack(header)[0])


def _die_with_parent() -> None:
    """SIGKILL when the parent dies, even in the middle of a check (Linux; elsewhere stdin's EOF)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(0)


def _serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    from serve.core.structured_output import ll_tokenizer, parser_limits, validate  # llguidance: the child only

    launch = _read_frame(stdin)
    if launch is None:
        return
    tokenizer_json, vocab_size, eos = msgspec.msgpack.decode(launch)
    tokenizer, limits = ll_tokenizer(tokenizer_json, vocab_size, eos), parser_limits()
    _write_frame(stdout, None)  # ready
    while (frame := _read_frame(stdin)) is not None:
        error: str | None = None
        try:
            validate(msgspec.msgpack.decode(frame, type=StructuredOutputsParams), tokenizer, limits)
        except (ValueError, msgspec.ValidationError) as e:
            error = str(e)
        _write_frame(stdout, error)


def main() -> None:
    """The child: frames of msgpack on stdin (first the tokenizer, then one constraint each), one reply
    frame each on stdout (None, or why the constraint is invalid)."""
    _die_with_parent()
    threading.stack_size(CHECKER_STACK_BYTES)
    worker = threading.Thread(target=_serve, args=(sys.stdin.buffer, sys.stdout.buffer), name="grammar-check")
    worker.start()
    worker.join()
