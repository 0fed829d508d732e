"""The one channel between frontend and core (serve.core.transport): frames arrive whole, in order and
of their kind, whatever their size or how the writes split; heartbeats are counted, not returned; a
stream that ends inside a frame says so."""

import asyncio
import os
import threading

import msgspec
import numpy as np
import pytest

from serve.core.transport import (
    HEADER,
    AsyncFrameWriter,
    FrameReader,
    FrameWriter,
    Kind,
    TornFrameError,
    decoders,
    encode,
    frame_bytes,
    open_pipe,
    write_frame,
)
from serve.sampling_params import SamplingParams
from serve.types import AbortRequests, EngineCoreOutputs, EngineCoreReady, EngineCoreRequest, StartupError, UtilityCall


def test_frames_arrive_whole_and_in_order():
    """Small and large frames (a large one is over the pipe's capacity, so its writer blocks until
    the reader drains it) and an empty one, written from a thread as the core's sender does."""
    rng = np.random.default_rng(0)
    frames = [(Kind.OUTPUTS, rng.bytes(int(n))) for n in (1, 7, 0, 3 << 20, 4096, 65537, 12)]
    r, w = open_pipe()
    reader = FrameReader(r)

    def writer() -> None:
        for kind, frame in frames:
            write_frame(w, kind, frame)
        os.close(w)

    async def read_all() -> list[tuple[Kind, bytes]]:
        thread = threading.Thread(target=writer)
        thread.start()
        got = [await asyncio.wait_for(reader.read(), 30) for _ in frames]
        thread.join()
        return got

    assert asyncio.run(read_all()) == frames
    reader.close()
    reader.close()  # twice is fine (the engine's shutdown may close its core twice)


def test_a_frame_split_across_writes_waits_for_its_last_byte():
    r, w = open_pipe()
    reader = FrameReader(r)
    data = frame_bytes(Kind.OUTPUTS, b"hello") + frame_bytes(Kind.READY, b"abc")
    assert data[: HEADER.size] == HEADER.pack(5, Kind.OUTPUTS)

    async def main() -> list[tuple[Kind, bytes]]:
        task = asyncio.ensure_future(reader.read())
        for i in range(len(data)):  # one byte at a time, the event loop running between them
            os.write(w, data[i : i + 1])
            await asyncio.sleep(0.001)
        return [await task, await reader.read()]

    assert asyncio.run(main()) == [(Kind.OUTPUTS, b"hello"), (Kind.READY, b"abc")]
    os.close(w)
    reader.close()


def test_after_the_writer_is_gone_a_read_waits_until_cancelled():
    """The core's death is the watcher's to report: a read at the pipe's end neither spins nor raises."""
    r, w = open_pipe()
    reader = FrameReader(r)
    write_frame(w, Kind.OUTPUTS, b"last")
    os.close(w)

    async def main() -> None:
        assert await reader.read() == (Kind.OUTPUTS, b"last")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(), 0.2)

    asyncio.run(main())
    reader.close()


def test_writing_to_a_closed_reader_is_a_broken_pipe():
    r, w = open_pipe()
    os.close(r)
    with pytest.raises(BrokenPipeError):
        write_frame(w, Kind.OUTPUTS, b"x")
    os.close(w)


@pytest.mark.parametrize("awaited", [False, True])
def test_a_stream_torn_inside_a_frame_is_a_clear_error_for_both_readers(awaited):
    """Its writer died mid-frame: the frames before it arrive, then TornFrameError says how much came."""
    r, w = open_pipe()
    reader = FrameReader(r)
    os.write(w, frame_bytes(Kind.OUTPUTS, b"whole") + frame_bytes(Kind.OUTPUTS, b"0123456789")[:9])
    os.close(w)

    async def main() -> None:
        assert await reader.read() == (Kind.OUTPUTS, b"whole")
        with pytest.raises(TornFrameError, match="ended inside a frame: 9 bytes"):
            await asyncio.wait_for(reader.read(), 5)

    if awaited:
        asyncio.run(main())
    else:
        assert reader.wait(5) and reader.take() == [(Kind.OUTPUTS, b"whole")]
        with pytest.raises(TornFrameError, match="ended inside a frame: 9 bytes"):
            reader.take()
    reader.close()


def test_the_cores_loop_takes_what_is_there_and_learns_when_the_frontend_is_gone():
    """take() never waits; wait() wakes for a frame (or times out); a clean end is an EOFError."""
    r, w = open_pipe()
    reader = FrameReader(r)
    assert reader.take() == [] and not reader.wait(0.05)
    write_frame(w, Kind.ABORT, b"a")
    write_frame(w, Kind.UTILITY, b"u")
    assert reader.wait(5)
    assert reader.take() == [(Kind.ABORT, b"a"), (Kind.UTILITY, b"u")]
    os.close(w)
    assert reader.wait(5)
    with pytest.raises(EOFError) as ended:
        reader.take()
    assert not isinstance(ended.value, TornFrameError)
    reader.close()


def test_heartbeats_are_counted_wherever_they_fall_and_never_returned():
    """Beats from one thread and messages from another share the pipe under one lock: every frame
    arrives whole, and a pump (the frontend's watcher) hears beats while nobody awaits an output."""
    r, w = open_pipe()
    reader = FrameReader(r)
    out = FrameWriter(w)
    big = bytes(range(256)) * 4096  # 1 MiB: written in pieces, with beats waiting for the lock
    done = threading.Event()

    def beat() -> None:
        for _ in range(200):
            out.write(Kind.HEARTBEAT)
        done.set()

    def send() -> None:
        for _ in range(3):
            out.write(Kind.OUTPUTS, big)

    threads = [threading.Thread(target=beat), threading.Thread(target=send)]
    for thread in threads:
        thread.start()
    payloads = []
    while len(payloads) < 3 or not done.is_set() or reader.heartbeats < 200:
        reader.wait(1)
        payloads += reader.take()
    for thread in threads:
        thread.join()
    assert payloads == [(Kind.OUTPUTS, big)] * 3 and reader.heartbeats == 200
    out.write(Kind.HEARTBEAT)
    reader.pump()
    assert reader.heartbeats == 201 and reader.take() == []
    os.close(w)
    reader.close()


def test_every_message_round_trips_as_its_kind():
    """Ready, startup errors, outputs, requests, aborts and utility calls: a kind each, decoded as its type."""
    messages = [
        EngineCoreReady(10, 64, 100, [2]),
        StartupError("no weights"),
        EngineCoreOutputs(rejected=[("r", "why")]),
        EngineCoreRequest("r", [1, 2], SamplingParams(max_tokens=2), 0, 0.0),
        AbortRequests(["r"], [("s", 1)]),
        UtilityCall(3, "stats"),
    ]
    kinds = [Kind.READY, Kind.STARTUP_ERROR, Kind.OUTPUTS, Kind.REQUEST, Kind.ABORT, Kind.UTILITY]
    r, w = open_pipe()
    reader = FrameReader(r)
    out = FrameWriter(w)
    for msg in messages:
        out.send(msg)
    assert reader.wait(5)
    frames = reader.take()
    assert [k for k, _ in frames] == kinds
    decode = decoders(*kinds)
    assert [decode[k].decode(p) for k, p in frames] == messages
    assert encode(messages[0])[0] is Kind.READY
    with pytest.raises(msgspec.ValidationError):
        decode[Kind.ABORT].decode(frames[0][1])
    os.close(w)
    reader.close()


def test_a_frame_of_unknown_kind_is_a_clear_error():
    r, w = open_pipe()
    reader = FrameReader(r)
    os.write(w, HEADER.pack(2, 99) + b"xx")
    with pytest.raises(ValueError, match="unknown kind 99"):
        reader.wait(5)
    os.close(w)
    reader.close()


def test_the_async_writer_never_blocks_its_loop_and_delivers_in_order():
    """More than the pipe holds, written from the event loop while a slow thread reads: writes queue
    (waiting past the high-water mark) and every frame arrives whole, in order; once the reader is
    gone a write is a BrokenPipeError."""
    r, w = open_pipe()
    reader = FrameReader(r)
    frames = [(Kind.REQUEST, bytes([i % 256]) * (300_000 + i)) for i in range(12)]  # ~3.6 MB
    got: list[tuple[Kind, bytes]] = []

    def read_slowly() -> None:
        while len(got) < len(frames):
            reader.wait(1)
            got.extend(reader.take())

    async def main() -> None:
        writer = AsyncFrameWriter(w)
        thread = threading.Thread(target=read_slowly)
        thread.start()
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while thread.is_alive():
                ticks += 1
                await asyncio.sleep(0.001)

        ticker = asyncio.ensure_future(tick())
        await asyncio.gather(*(writer.write(k, p) for k, p in frames))
        await asyncio.to_thread(thread.join, 30)
        await ticker
        assert ticks > 0  # the loop ran while the writes waited for the reader
        reader.close()
        with pytest.raises(BrokenPipeError):
            for _ in range(3):  # the first may land in the queue before the pipe reports it
                await writer.write(Kind.ABORT, b"x")
        writer.close()
        writer.close()

    asyncio.run(main())
    assert got == frames
