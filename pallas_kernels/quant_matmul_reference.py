"""Quantized matmuls in plain jax.numpy: the references the Pallas kernels are tested against, and
the layout they share.

Weights are [K, N] (y = x @ W). int8 weights are stored as int8 [K, N]; int4 weights as uint8
[K/2, N] holding unsigned nibbles u in [0, 15], packed per group of g = K / G rows so that byte j of a
group holds row j in its low nibble and row j + g/2 in its high nibble (a kernel then needs no
interleave: two half-group matmuls). Scales and zero points are [G, N]; W = (u - z) * s with the
zero point z defaulting to 0 (int8) or 8 (int4) when the weights are symmetric.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

SYMMETRIC_ZERO = {8: 0, 4: 8}


def group_size(k: int, scales: jax.Array) -> int:
    """Rows per quantization group: K / G."""
    groups = scales.shape[0]
    if groups < 1 or k % groups:
        raise ValueError(f"scales have {groups} groups, which does not divide K={k}")
    return k // groups


def pack_int4(u: Int[Array, "K N"], group: int) -> Shaped[Array, "K2 N"]:
    """Unsigned nibbles [K, N] (0..15) -> uint8 [K/2, N] in the half-group layout above."""
    k, n = u.shape
    if group % 2 or k % group:
        raise ValueError(f"int4 packing needs an even group size dividing K={k}, got {group}")
    g = u.astype(jnp.uint8).reshape(k // group, 2, group // 2, n)
    return (g[:, 0] | (g[:, 1] << 4)).reshape(k // 2, n)


def unpack_int4(packed: Shaped[Array, "K2 N"], group: int) -> Shaped[Array, "K N"]:
    """uint8 [K/2, N] -> nibbles uint8 [K, N] (the inverse of pack_int4)."""
    k2, n = packed.shape
    g = packed.reshape(2 * k2 // group, 1, group // 2, n)
    return jnp.concatenate([g & 0xF, g >> 4], axis=1).reshape(2 * k2, n)


def weight_rows(qweight: jax.Array, bits: int) -> int:
    """K, the number of input rows the stored weight covers."""
    return qweight.shape[0] * (2 if bits == 4 else 1)


def dequantize_weight(
    qweight: Shaped[Array, "KP N"],
    scales: Float[Array, "G N"],
    zeros: Shaped[Array, "G N"] | None,
    *,
    bits: int,
    dtype: jnp.dtype = jnp.float32,
) -> Float[Array, "K N"]:
    """Stored weight -> dense [K, N] in `dtype`."""
    k = weight_rows(qweight, bits)
    g = group_size(k, scales)
    q = unpack_int4(qweight, g) if bits == 4 else qweight
    z = jnp.full(scales.shape, SYMMETRIC_ZERO[bits], jnp.float32) if zeros is None else zeros.astype(jnp.float32)
    w = (q.astype(jnp.float32).reshape(k // g, g, -1) - z[:, None]) * scales.astype(jnp.float32)[:, None]
    return w.reshape(k, -1).astype(dtype)


def weight_only_matmul_reference(
    x: Float[Array, "M K"],
    qweight: Shaped[Array, "KP N"],
    scales: Float[Array, "G N"],
    zeros: Shaped[Array, "G N"] | None,
    *,
    bits: int,
) -> Float[Array, "M N"]:
    """x @ dequantize(W) with float32 accumulation, output in x's dtype (W8A16 / W4A16)."""
    w = dequantize_weight(qweight, scales, zeros, bits=bits, dtype=x.dtype)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32).astype(x.dtype)


def quantize_activations(x: Float[Array, "M K"]) -> tuple[Int[Array, "M K"], Float[Array, " M"]]:
    """Dynamic symmetric int8 per token (row): x ~= xq * scale."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax == 0, 1.0, amax / 127.0)
    return jnp.clip(jnp.round(xf / scale[:, None]), -127, 127).astype(jnp.int8), scale


def int8_matmul_reference(
    xq: Int[Array, "M K"],
    x_scale: Float[Array, " M"],
    wq: Int[Array, "K N"],
    w_scale: Float[Array, " N"],
    *,
    out_dtype: jnp.dtype,
) -> Float[Array, "M N"]:
    """W8A8: int8 x int8 -> int32, scaled per token and per output channel in the epilogue."""
    acc = jnp.dot(xq, wq, preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * x_scale[:, None] * w_scale.astype(jnp.float32)[None, :]).astype(out_dtype)
