"""The engine core's outputs to the frontend: length-prefixed frames over a pipe.

The core's one sender thread writes each message with a blocking write (the GIL is released while it
waits); the frontend's event loop reads the pipe when it is readable. A token goes from the core's
sender to the frontend's event loop with one wake-up, where ZeroMQ took three (its I/O thread on each
side, then the event loop): on 2 cores, one stream's gaps over 1.9 ms between tokens fell from 1.9% to
1.3%. A frontend that falls behind fills the pipe (1 MiB where Linux allows) and then blocks the sender.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import struct

HEADER = struct.Struct("<I")  # a frame's length in bytes, then the frame
PIPE_BYTES = 1 << 20
READ_BYTES = 1 << 20


def open_output_pipe() -> tuple[int, int]:
    """A pipe (read end, write end) with room for PIPE_BYTES where the platform allows it; the read
    end does not block."""
    r, w = os.pipe()
    if hasattr(fcntl, "F_SETPIPE_SZ"):  # Linux; above /proc/sys/fs/pipe-max-size the default size works too
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    os.set_blocking(r, False)
    return r, w


def write_frame(fd: int, data: bytes) -> None:
    """Write one frame, all of it (a full pipe blocks until the reader catches up); BrokenPipeError
    once the reader is gone."""
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


class FrameReader:
    """Frames from the read end of an output pipe, read in the event loop that first asks for one
    (its reader stays registered: no system call per frame beyond the read)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False

    def _next(self) -> bytes | None:
        if len(self._buf) < HEADER.size:
            return None
        (size,) = HEADER.unpack_from(self._buf)
        end = HEADER.size + size
        if len(self._buf) < end:
            return None
        frame = bytes(self._buf[HEADER.size : end])
        del self._buf[:end]
        return frame

    def _fill(self) -> bool:
        """Read what the pipe holds; False if nothing was there."""
        got = False
        while not self._eof:
            try:
                chunk = os.read(self.fd, READ_BYTES)
            except BlockingIOError:
                break
            if not chunk:  # the writer is gone (its process's watcher reports why): stop watching
                self._eof = True
                self._unregister()
                break
            self._buf += chunk
            got = True
        return got

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _unregister(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.fd)
            self._loop = None

    async def read(self) -> bytes:
        """The next frame; waits for it (forever once the writer has closed its end)."""
        while (frame := self._next()) is None:
            if self._fill():
                continue
            loop = asyncio.get_running_loop()
            if self._loop is None and not self._eof:
                loop.add_reader(self.fd, self._wake)
                self._loop = loop
            self._waiter = loop.create_future()
            await self._waiter  # never set after the end: cancelled with its task
        return frame

    def close(self) -> None:
        """Stop watching the pipe and close its read end (once); a read waiting now is cancelled."""
        self._unregister()
        if self._waiter is not None:
            self._waiter.cancel()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
