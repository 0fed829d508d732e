"""The one channel between the frontend and its engine-core process: length-prefixed frames, each of
a `Kind`, over one pipe each way (frontend -> core: requests, aborts, utility calls; core -> frontend:
ready or its startup error, outputs, heartbeats).

Pipes, not ZeroMQ: a token goes from the core's sender to the frontend's event loop with one wake-up,
where ZeroMQ took three (its I/O thread on each side, then the event loop): on 2 cores, one stream's
gaps over 1.9 ms between tokens fell from 1.9% to 1.3%. The core's threads (its sender, its heartbeat)
write whole frames under one lock, so frames never interleave; the reader counts heartbeats as it
parses, whoever asks it to read, so a watcher hears them while nobody awaits an output. A reader
that falls behind fills its pipe (1 MiB where Linux allows) and then blocks the writer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import fcntl
import os
import select
import struct
import threading

import msgspec

from serve.types import AbortRequests, EngineCoreOutputs, EngineCoreReady, EngineCoreRequest, StartupError, UtilityCall

HEADER = struct.Struct("<IB")  # the payload's length in bytes and the frame's Kind, then the payload
PIPE_BYTES = 1 << 20
READ_BYTES = 1 << 20
HIGH_WATER = 1 << 20  # bytes an async writer queues beyond its pipe before a write waits for it to drain


class Kind(enum.IntEnum):
    """What a frame carries: a msgpack-encoded message of MESSAGE_TYPES[kind], or nothing (a heartbeat)."""

    REQUEST = 1  # frontend -> core
    ABORT = 2
    UTILITY = 3
    READY = 4  # core -> frontend: once, when loaded and warmed up (or STARTUP_ERROR instead)
    STARTUP_ERROR = 5
    OUTPUTS = 6
    HEARTBEAT = 7  # from a thread of the core's own, every HEARTBEAT_INTERVAL_S while it runs


Message = EngineCoreRequest | AbortRequests | UtilityCall | EngineCoreReady | StartupError | EngineCoreOutputs
Frame = tuple[Kind, bytes]
MESSAGE_TYPES: dict[Kind, type] = {
    Kind.REQUEST: EngineCoreRequest,
    Kind.ABORT: AbortRequests,
    Kind.UTILITY: UtilityCall,
    Kind.READY: EngineCoreReady,
    Kind.STARTUP_ERROR: StartupError,
    Kind.OUTPUTS: EngineCoreOutputs,
}
KINDS: dict[type, Kind] = {t: k for k, t in MESSAGE_TYPES.items()}


class TornFrameError(EOFError):
    """The stream ended inside a frame: its writer died while writing it."""


def encode(msg: Message) -> Frame:
    """A message's frame kind and payload."""
    return KINDS[type(msg)], msgspec.msgpack.encode(msg)


def decoders(*kinds: Kind) -> dict[Kind, msgspec.msgpack.Decoder]:
    """A decoder per kind, of its message type."""
    return {k: msgspec.msgpack.Decoder(MESSAGE_TYPES[k]) for k in kinds}


def open_pipe() -> tuple[int, int]:
    """A pipe (read end, write end) with room for PIPE_BYTES where the platform allows it; the read
    end does not block."""
    r, w = os.pipe()
    if hasattr(fcntl, "F_SETPIPE_SZ"):  # Linux; above /proc/sys/fs/pipe-max-size the default size works too
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    os.set_blocking(r, False)
    return r, w


def frame_bytes(kind: Kind, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind) + payload


def write_frame(fd: int, kind: Kind, payload: bytes = b"") -> None:
    """Write one frame, all of it (a full pipe blocks until the reader catches up); BrokenPipeError
    once the reader is gone."""
    view = memoryview(frame_bytes(kind, payload))
    while view:
        view = view[os.write(fd, view) :]


class FrameWriter:
    """Blocking writes of whole frames to one pipe from any thread (one lock: frames never interleave)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()

    def write(self, kind: Kind, payload: bytes = b"") -> None:
        with self._lock:
            write_frame(self.fd, kind, payload)

    def send(self, msg: Message) -> None:
        self.write(*encode(msg))


class AsyncFrameWriter:
    """Frames written from an event loop without blocking it: what the pipe cannot take now is queued
    and written when it can; a write waits only while over HIGH_WATER bytes are queued.
    BrokenPipeError once the reader is gone."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._buf = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None  # while it waits for the pipe to take more
        self._drains: list[asyncio.Future[None]] = []
        self._broken = False

    async def write(self, kind: Kind, payload: bytes = b"") -> None:
        if self._broken or self.fd < 0:
            raise BrokenPipeError("the channel's reader is gone")
        self._buf += frame_bytes(kind, payload)
        self._flush()
        if len(self._buf) > HIGH_WATER:
            drained = asyncio.get_running_loop().create_future()
            self._drains.append(drained)
            await drained

    def _flush(self) -> None:
        try:
            while self._buf:
                del self._buf[: os.write(self.fd, self._buf)]
        except BlockingIOError:
            pass
        except BrokenPipeError:
            self._broken = True
            self._buf.clear()
        if self._buf and self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_writer(self.fd, self._flush)
        elif not self._buf:
            self._unregister()
        if len(self._buf) <= HIGH_WATER:
            for drained in self._drains:
                if drained.done():
                    continue
                if self._broken:
                    drained.set_exception(BrokenPipeError("the channel's reader is gone"))
                else:
                    drained.set_result(None)
            self._drains.clear()

    def _unregister(self) -> None:
        if self._loop is not None:
            self._loop.remove_writer(self.fd)
            self._loop = None

    def close(self) -> None:
        """Stop writing and close the write end (once); a write waiting now is cancelled."""
        self._unregister()
        for drained in self._drains:
            drained.cancel()
        self._drains.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class FrameReader:
    """Frames from the read end of a pipe: taken now (`take`, `wait`: the core's loop) or awaited
    (`read`: in the event loop that first asks, its reader staying registered, no system call per frame
    beyond the read). Heartbeats are counted (`heartbeats`), not returned."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.heartbeats = 0
        self._buf = bytearray()
        self._frames: collections.deque[Frame] = collections.deque()
        self._eof = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None

    def _parse(self) -> None:
        while len(self._buf) >= HEADER.size:
            size, kind = HEADER.unpack_from(self._buf)
            end = HEADER.size + size
            if len(self._buf) < end:
                return
            payload = bytes(self._buf[HEADER.size : end])
            del self._buf[:end]
            try:
                frame_kind = Kind(kind)
            except ValueError:
                raise ValueError(f"a frame of unknown kind {kind} ({size} bytes): the stream is corrupt") from None
            if frame_kind is Kind.HEARTBEAT:
                self.heartbeats += 1
            else:
                self._frames.append((frame_kind, payload))

    def pump(self) -> None:
        """Read and parse what the pipe holds now, without waiting (a waiting `read` wakes for it)."""
        while not self._eof:
            try:
                chunk = os.read(self.fd, READ_BYTES)
            except BlockingIOError:
                break
            if not chunk:  # every writer is gone
                self._eof = True
                self._unregister()
                break
            self._buf += chunk
        self._parse()
        if self._frames:
            self._wake()

    def _check_end(self) -> None:
        """At the end of the stream with nothing queued: TornFrameError if it ended inside a frame."""
        if self._eof and not self._frames and self._buf:
            raise TornFrameError(
                f"the stream ended inside a frame: {len(self._buf)} bytes of it arrived, "
                f"its writer died while writing it"
            )

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for a frame or the end of the stream; True if either is there."""
        if not self._frames and not self._eof:
            select.select([self.fd], [], [], timeout)
            self.pump()
        return bool(self._frames) or self._eof

    def take(self) -> list[Frame]:
        """Every frame there now; EOFError (TornFrameError if inside a frame) once the stream ended
        and every frame was taken."""
        self.pump()
        if not self._frames and self._eof:
            self._check_end()
            raise EOFError("the stream ended")
        frames = list(self._frames)
        self._frames.clear()
        return frames

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _unregister(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.fd)
            self._loop = None

    async def read(self) -> Frame:
        """The next frame; waits for it, forever once the writer has closed its end after a whole frame
        (its process's watcher says why), TornFrameError if it closed it inside one."""
        while not self._frames:
            self.pump()
            if self._frames:
                break
            self._check_end()
            loop = asyncio.get_running_loop()
            if self._loop is None and not self._eof:
                loop.add_reader(self.fd, self._wake)
                self._loop = loop
            self._waiter = loop.create_future()
            await self._waiter  # never set after the end: cancelled with its task
        return self._frames.popleft()

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def close(self) -> None:
        """Stop watching the pipe and close its read end (once); a read waiting now is cancelled."""
        self._unregister()
        if self._waiter is not None:
            self._waiter.cancel()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
