"""Building our C++ XLA FFI libraries for CPUs from source, once per source, flags, jaxlib and machine.

A library is compiled with the system C++ compiler into a cache folder keyed by all of these, so a
changed source or jaxlib rebuilds it, and a cache folder shared between machines never hands one
another's build.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
CACHE_ENV = "JAXINFRA_KERNEL_CACHE"  # where built libraries go (default ~/.cache/jaxinfra/cpu-kernels)


class KernelUnavailable(RuntimeError):
    """The CPU kernel could not be built here (no C++ compiler, or it failed)."""


def compiler() -> str | None:
    """The C++ compiler to build with: $CXX, else g++ or clang++ on the PATH."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


@functools.cache
def _toolchain() -> str:
    """What else decides the built code: the machine, its CPU's instruction sets (-march=native) and the
    compiler's version, so a cache folder shared between machines never hands one another's library."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    version = ""
    cxx = compiler()
    if cxx is not None:
        try:
            done = subprocess.run([*shlex.split(cxx), "--version"], capture_output=True, text=True, timeout=60)
            version = done.stdout
        except (OSError, subprocess.TimeoutExpired):
            version = "unusable"
    return "\n".join((platform.machine(), flags, version))


def library_path(source: Path) -> Path:
    """Where the library of `source` for these flags, this jaxlib and this toolchain lives (built or not)."""
    parts = (source.read_bytes(), " ".join(FLAGS).encode(), jaxlib.__version__.encode(), _toolchain().encode())
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxinfra" / "cpu-kernels")
    return root / key[:16] / f"lib{source.stem}.so"


def build(source: Path) -> Path:
    """Compile `source`'s library unless it is already built; written to a temporary name and renamed,
    so concurrent builders (test workers) never load a half-written file."""
    path = library_path(source)
    if path.exists():
        return path
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable(f"no C++ compiler (set CXX, or install g++) to build {source.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [*shlex.split(cxx), *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp]
    try:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise KernelUnavailable(f"cannot run the C++ compiler {cxx!r}: {e}") from e
        if done.returncode:
            command = " ".join(cmd)
            raise KernelUnavailable(f"building {source.name} failed:\n{command}\n{done.stderr[-4000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load(source: Path, targets: dict[str, str]) -> ctypes.CDLL:
    """`source`'s library, built if needed and loaded, with each XLA FFI target (name: the handler symbol
    it exports) registered for CPU."""
    lib = ctypes.cdll.LoadLibrary(str(build(source)))
    for name, symbol in targets.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib
