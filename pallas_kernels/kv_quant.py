"""Quantized KV storage: int8 or fp8 (e4m3) values with a float32 scale per token and head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

# Storage dtype -> the largest magnitude it holds (the scale maps each token-head's amax onto it).
KV_QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def is_quantized_kv(dtype: jnp.dtype | str) -> bool:
    """Pools of this dtype carry per-token, per-head scales."""
    return jnp.dtype(dtype) in KV_QUANT_MAX


def dequantize(pool: jax.Array, scales: jax.Array | None, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Quantized pool [NB, BS, KH, D] with per-token, per-head scales [NB, BS, KH] -> float pool."""
    if scales is None:
        return pool
    return (pool.astype(jnp.float32) * scales[..., None]).astype(dtype)


def quantize(
    x: Float[Array, "N KH D"], dtype: jnp.dtype = jnp.int8
) -> tuple[Shaped[Array, "N KH D"], Float[Array, "N KH"]]:
    """Symmetric per (token, head): x ~= q * scale, q int8 (rounded) or fp8 e4m3 (cast)."""
    top = KV_QUANT_MAX[jnp.dtype(dtype)]
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax == 0, 1.0, amax / top)
    y = jnp.clip(xf / scale[..., None], -top, top)
    return (jnp.round(y) if jnp.dtype(dtype) == jnp.int8 else y).astype(dtype), scale
