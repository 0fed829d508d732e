"""The core's output pipe: frames arrive whole and in order, whatever their size or how the writes split."""

import asyncio
import os
import threading

import numpy as np
import pytest

from serve.core.output_pipe import HEADER, FrameReader, open_output_pipe, write_frame


def test_frames_arrive_whole_and_in_order():
    """Small and large frames (a large one is over the pipe's capacity, so its writer blocks until
    the reader drains it) and an empty one, written from a thread as the core's sender does."""
    rng = np.random.default_rng(0)
    frames = [rng.bytes(int(n)) for n in (1, 7, 0, 3 << 20, 4096, 65537, 12)]
    r, w = open_output_pipe()
    reader = FrameReader(r)

    def writer() -> None:
        for frame in frames:
            write_frame(w, frame)
        os.close(w)

    async def read_all() -> list[bytes]:
        thread = threading.Thread(target=writer)
        thread.start()
        got = [await asyncio.wait_for(reader.read(), 30) for _ in frames]
        thread.join()
        return got

    assert asyncio.run(read_all()) == frames
    reader.close()
    reader.close()  # twice is fine (the engine's shutdown may close its core twice)


def test_a_frame_split_across_writes_waits_for_its_last_byte():
    r, w = open_output_pipe()
    reader = FrameReader(r)
    data = HEADER.pack(5) + b"hello" + HEADER.pack(3) + b"abc"

    async def main() -> list[bytes]:
        task = asyncio.ensure_future(reader.read())
        for i in range(len(data)):  # one byte at a time, the event loop running between them
            os.write(w, data[i : i + 1])
            await asyncio.sleep(0.001)
        return [await task, await reader.read()]

    assert asyncio.run(main()) == [b"hello", b"abc"]
    os.close(w)
    reader.close()


def test_after_the_writer_is_gone_a_read_waits_until_cancelled():
    """The core's death is the watcher's to report: a read at the pipe's end neither spins nor raises."""
    r, w = open_output_pipe()
    reader = FrameReader(r)
    write_frame(w, b"last")
    os.close(w)

    async def main() -> None:
        assert await reader.read() == b"last"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(), 0.2)

    asyncio.run(main())
    reader.close()


def test_writing_to_a_closed_reader_is_a_broken_pipe():
    r, w = open_output_pipe()
    os.close(r)
    with pytest.raises(BrokenPipeError):
        write_frame(w, b"x")
    os.close(w)
