"""Ragged paged attention on CPU: our C++ kernel (`cpu_paged_attention.cc`) as an XLA FFI custom call.

The library is compiled from source with the system C++ compiler (`make setup` does it at install;
otherwise the first call does) into a cache folder keyed by the source, the flags and jaxlib, so a
changed source or jaxlib rebuilds it. Float32 pools only: the XLA formulation serves the others.

    python -m pallas_kernels.cpu_paged_attention   # build now, print the library's path
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
import jax.numpy as jnp
import jaxlib
import numpy as np
from jaxtyping import Array, Float, Int

SOURCE = Path(__file__).with_suffix(".cc")
TARGET = "jaxinfra_ragged_paged_attention"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
CACHE_ENV = "JAXINFRA_KERNEL_CACHE"  # where built libraries go (default ~/.cache/jaxinfra/cpu-kernels)


def reads(pool_dtype: jnp.dtype) -> bool:
    """Whether the kernel reads pools of this dtype (float32 only; int8/fp8/bf16 take the XLA formulation)."""
    return jnp.dtype(pool_dtype) == jnp.float32


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


def library_path() -> Path:
    """Where the library for this source, these flags, this jaxlib and this toolchain lives (built or not)."""
    parts = (SOURCE.read_bytes(), " ".join(FLAGS).encode(), jaxlib.__version__.encode(), _toolchain().encode())
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxinfra" / "cpu-kernels")
    return root / key[:16] / "libjaxinfra_cpu_attention.so"


def build() -> Path:
    """Compile the library unless this source's is already built; written to a temporary name and
    renamed, so concurrent builders (test workers) never load a half-written file."""
    path = library_path()
    if path.exists():
        return path
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler (set CXX, or install g++) to build the CPU attention kernel")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [*shlex.split(cxx), *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    try:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise KernelUnavailable(f"cannot run the C++ compiler {cxx!r}: {e}") from e
        if done.returncode:
            command = " ".join(cmd)
            raise KernelUnavailable(f"building the CPU attention kernel failed:\n{command}\n{done.stderr[-4000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def register() -> None:
    """Build (if needed), load and register the custom call once per process."""
    lib = ctypes.cdll.LoadLibrary(str(build()))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxinfraRaggedPagedAttention), platform="cpu")


@functools.cache
def available() -> bool:
    """Whether the kernel can run here (it builds and loads); False when it cannot, never raising."""
    try:
        register()
    except (KernelUnavailable, OSError):
        return False
    return True


def ragged_paged_attention_cpu(
    q: Float[Array, "N H D"],
    k_pool: Float[Array, "NB BS KH D"],
    v_pool: Float[Array, "NB BS KH D"],
    block_tables: Int[Array, "S MB"],
    cu_q_lens: Int[Array, " S1"],
    kv_lens: Int[Array, " S"],
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
) -> Float[Array, "N H D"]:
    """Same contract as `ragged_paged_attention_reference`, for float32 pools, on CPU."""
    if not (reads(k_pool.dtype) and reads(v_pool.dtype)):
        raise ValueError(f"the CPU paged-attention kernel takes float32 pools, got {k_pool.dtype}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    register()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(
        q.astype(jnp.float32),
        k_pool,
        v_pool,
        block_tables.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        scale=np.float32(q.shape[-1] ** -0.5 if scale is None else scale),
        window=np.int64(sliding_window or 0),
        softcap=np.float32(logit_softcap or 0.0),
    )
    return out.astype(q.dtype)


if __name__ == "__main__":
    print(build())
