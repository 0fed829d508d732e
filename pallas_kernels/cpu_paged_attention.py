"""Ragged paged attention on CPU: our C++ kernel (`cpu_paged_attention.cc`) as an XLA FFI custom call.

The library is compiled from source with the system C++ compiler (`make setup` does it at install;
otherwise the first call does; pallas_kernels.cpu_build). Float32 pools only: the XLA formulation
serves the others.

    python -m pallas_kernels.cpu_paged_attention   # build now, print the library's path
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels import cpu_build
from pallas_kernels.cpu_build import KernelUnavailable

SOURCE = Path(__file__).with_suffix(".cc")
TARGET = "jaxinfra_ragged_paged_attention"


def reads(pool_dtype: jnp.dtype) -> bool:
    """Whether the kernel reads pools of this dtype (float32 only; int8/fp8/bf16 take the XLA formulation)."""
    return jnp.dtype(pool_dtype) == jnp.float32


def build() -> Path:
    """The kernel's library, compiled unless already built (pallas_kernels.cpu_build)."""
    return cpu_build.build(SOURCE)


@functools.cache
def register() -> None:
    """Build (if needed), load and register the custom call once per process."""
    cpu_build.load(SOURCE, {TARGET: "JaxinfraRaggedPagedAttention"})


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
