"""int8 KV storage: symmetric per-token, per-head quantisation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def dequantize(pool: jax.Array, scales: jax.Array | None, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """int8 pool [NB, BS, KH, D] with per-token, per-head scales [NB, BS, KH] -> float pool."""
    if scales is None:
        return pool
    return (pool.astype(jnp.float32) * scales[..., None]).astype(dtype)


def quantize(x: Float[Array, "N KH D"]) -> tuple[Int[Array, "N KH D"], Float[Array, "N KH"]]:
    """Symmetric int8 per (token, head): x ~= q * scale."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = jnp.where(amax == 0, 1.0, amax / 127.0)
    q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale
