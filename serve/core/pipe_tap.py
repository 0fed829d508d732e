"""One ordered channel into the core's sender thread: a pipe that the decode loops' device taps write
their tokens to from XLA's threads (pipe_tap.cc, an XLA FFI call, no Python) and the core's Python
threads write markers to, one per message they queue; the sender reads it in the order written.

On one CPU device the tap is the C++ call; elsewhere (a mesh, a GPU), or where no C++ compiler can build
it, an io_callback writes the same message from Python.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import Mesh, SingleDeviceSharding

from pallas_kernels import cpu_build

SOURCE = Path(__file__).with_suffix(".cc")
TARGET = "jaxinfra_pipe_tap"
PIPE_BYTES = 1 << 20  # a full pipe would hold the loop: room for ~1000 iterations of 128 rows
FIRST_FD = 1000  # the write end's number is part of the compiled loop: a stable one keeps cache hits
_MARK = np.int32(-1).tobytes()
_SET_PIPE_SIZE = getattr(fcntl, "F_SETPIPE_SZ", 1031)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built tap library, its FFI target registered; None where it cannot be built or loaded."""
    try:
        lib = cpu_build.load(SOURCE, {TARGET: "JaxinfraPipeTap"})
    except (cpu_build.KernelUnavailable, OSError):
        return None
    lib.jaxinfra_pipe_write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    lib.jaxinfra_pipe_write.restype = ctypes.c_int
    return lib


class TapPipe:
    """Messages of int32 values (a tap's) and markers (-1), written from any thread, read by one."""

    def __init__(self) -> None:
        read_fd, self._write_fd = os.pipe()
        with contextlib.suppress(OSError):  # where the file limit is below FIRST_FD, any number will do
            stable = fcntl.fcntl(self._write_fd, fcntl.F_DUPFD_CLOEXEC, FIRST_FD)
            os.close(self._write_fd)
            self._write_fd = stable
        with contextlib.suppress(OSError):  # the default 64 KiB where the system caps pipe sizes lower
            fcntl.fcntl(self._write_fd, _SET_PIPE_SIZE, PIPE_BYTES)
        self._reader = os.fdopen(read_fd, "rb")
        self._lib = _library()
        self._lock = threading.Lock()  # Python's writes when there is no library (its writes take its lock)

    def write(self, values: np.ndarray) -> None:
        """One message of int32 values."""
        values = np.asarray(values, np.int32)
        self._write(np.int32(values.size).tobytes() + values.tobytes())

    def mark(self) -> None:
        """A marker: the reader takes the next message its writer queued elsewhere."""
        self._write(_MARK)

    def _write(self, data: bytes) -> None:
        if self._lib is not None:
            self._lib.jaxinfra_pipe_write(self._write_fd, data, len(data))  # ctypes lets go of the GIL
            return
        with self._lock:
            view = memoryview(data)
            while view:
                view = view[os.write(self._write_fd, view) :]

    def read(self) -> np.ndarray | None:
        """The next message's values, or None for a marker; blocks until one is there."""
        n = int.from_bytes(self._reader.read(4), "little", signed=True)
        return None if n < 0 else np.frombuffer(self._reader.read(4 * n), np.int32)

    def device_tap(self, mesh: Mesh | None = None) -> Callable[[jax.Array], jax.Array]:
        """A traced op writing its int32 vector as one message each time it runs, returning a receipt
        (int32 [1], no meaningful value) that the loop must carry to its outputs: declared free of side
        effects, so the jitted loop keeps JAX's C++ dispatch (an effect sends every call through
        Python's, 1-4 ms), while the carried receipt keeps XLA from dropping the call. On one CPU
        device the C++ call (~5 us, no GIL); otherwise an io_callback run by `mesh`'s first device."""
        if jax.default_backend() == "cpu" and mesh is None and self._lib is not None:
            call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((1,), jnp.int32))
            return lambda x: call(x.astype(jnp.int32), fd=np.int64(self._write_fd))
        device = None if mesh is None else SingleDeviceSharding(mesh.devices.flat[0])

        def elsewhere(x: jax.Array) -> jax.Array:
            io_callback(lambda arr: self.write(np.asarray(arr)), None, x, ordered=False, sharding=device)
            return jnp.zeros((1,), jnp.int32)

        return elsewhere

    def close(self) -> None:
        """Close the pipe (after the reader is done). The write end's number now points at /dev/null
        instead of being freed: a loop compiled with it may still run, and must not write into a file
        that reuses the number."""
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._write_fd)
        os.close(null)
        self._reader.close()


def build() -> Path:
    """The tap's library, compiled unless already built (`make setup` calls this at install)."""
    return cpu_build.build(SOURCE)


if __name__ == "__main__":
    print(build())
