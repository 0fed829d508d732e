"""Quantized matmuls in Pallas (Triton lowering), beside quant_matmul_reference.py.

W8A16 / W4A16: each program owns a [block_m, block_n] output tile and walks K one quantization
group at a time (or block_k rows for per-channel scales), loading int8 or packed-int4 weights,
unpacking nibbles and applying zero points and scales in registers, so HBM sees only the quantized
bytes. W8A8: int8 x int8 -> int32 accumulation with per-token and per-channel scales in the
epilogue. A small-M tiling serves decode, a large-M one prefill.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels.quant_matmul_reference import SYMMETRIC_ZERO, group_size, weight_rows
from pallas_kernels.tile_ops import dot


@dataclasses.dataclass(frozen=True)
class MatmulTiles:
    """Output tile and K step (per-channel scales only; grouped weights step one group)."""

    block_m: int
    block_n: int
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_tiles(m: int, n: int, k: int) -> MatmulTiles:
    """Decode (M <= 16): thin rows, wide columns; prefill: 64- or 128-row tiles."""
    if n % 16 or k % 16:
        raise ValueError(f"the Pallas quantized matmul needs N and K multiples of 16, got N={n}, K={k}")
    block_m = 16 if m <= 16 else 64 if m <= 64 else 128
    block_n = next(b for b in (128, 64, 32, 16) if n % b == 0)
    block_k = next(b for b in (64, 32, 16) if k % b == 0)
    return MatmulTiles(block_m, block_n, block_k, num_warps=4 if block_m * block_n <= 64 * 128 else 8)


def _check(m: int, n: int, k: int, tiles: MatmulTiles) -> None:
    for name, dim, block in (("N", n, tiles.block_n), ("K", k, tiles.block_k)):
        if dim % block:
            raise ValueError(f"{name}={dim} is not a multiple of the tile's {block}")


def _pad_rows(x: jax.Array, block_m: int) -> jax.Array:
    pad = -x.shape[0] % block_m
    return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _weight_only_kernel(x_ref, q_ref, s_ref, z_ref, o_ref, *, bits: int, group: int, step: int, symmetric: bool):
    k = x_ref.shape[1]
    per_channel = s_ref.shape[0] == 1
    acc0 = jnp.zeros(o_ref.shape, jnp.float32)

    def scale_zero(gi):
        s = s_ref[pl.ds(gi, 1), :].astype(jnp.float32)
        z = SYMMETRIC_ZERO[bits] if symmetric else z_ref[pl.ds(gi, 1), :].astype(jnp.float32)
        return s, z

    def dequant(u, gi):
        if per_channel and bits == 8:
            return u.astype(x_ref.dtype)  # scaled in the epilogue
        s, z = scale_zero(gi)
        return ((u.astype(jnp.float32) - z) * s).astype(x_ref.dtype)

    def body(i, acc):
        k0 = i * step
        gi = k0 // group
        if bits == 8:
            w = dequant(q_ref[pl.ds(k0, step), :], gi)
            return acc + dot(x_ref[:, pl.ds(k0, step)], w)
        half = step // 2
        p = q_ref[pl.ds(k0 // 2, half), :].astype(jnp.int32)
        lo, hi = dequant(p & 0xF, gi), dequant(p >> 4, gi)
        return acc + dot(x_ref[:, pl.ds(k0, half)], lo) + dot(x_ref[:, pl.ds(k0 + half, half)], hi)

    acc = lax.fori_loop(0, k // step, body, acc0)
    if per_channel and bits == 8:
        acc = acc * s_ref[...].astype(jnp.float32)
    o_ref[...] = acc.astype(o_ref.dtype)


def weight_only_matmul(
    x: Float[Array, "M K"],
    qweight: Shaped[Array, "KP N"],
    scales: Float[Array, "G N"],
    zeros: Shaped[Array, "G N"] | None,
    *,
    bits: int,
    tiles: MatmulTiles | None = None,
    interpret: bool | None = None,
) -> Float[Array, "M N"]:
    """x @ dequantize(W) for int8 or packed int4 W (layout in quant_matmul_reference), output in x's dtype."""
    if bits not in SYMMETRIC_ZERO:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    m, k = x.shape
    n = qweight.shape[1]
    if weight_rows(qweight, bits) != k:
        raise ValueError(f"x has K={k} but the {bits}-bit weight covers {weight_rows(qweight, bits)} rows")
    group = group_size(k, scales)
    tiles = tiles or default_tiles(m, n, k)
    _check(m, n, k, tiles)
    per_channel = scales.shape[0] == 1 and bits == 8
    step = tiles.block_k if per_channel else group
    if (step % 32 and bits == 4) or step % 16:
        raise ValueError(f"group size {group} is too small for the kernel (int4 needs >= 32, int8 >= 16)")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    xp = _pad_rows(x, tiles.block_m)
    bm, bn = tiles.block_m, tiles.block_n
    z = jnp.zeros((1, n), jnp.uint8) if zeros is None else zeros
    kernel = functools.partial(_weight_only_kernel, bits=bits, group=group, step=step, symmetric=zeros is None)
    out = pl.pallas_call(
        kernel,
        grid=(xp.shape[0] // bm, n // bn),
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
            pl.BlockSpec((qweight.shape[0], bn), lambda i, j: (0, j)),
            pl.BlockSpec((scales.shape[0], bn), lambda i, j: (0, j)),
            pl.BlockSpec((z.shape[0], bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], n), x.dtype),
        name=f"jaxinfra_w{bits}a16_matmul",
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
    )(xp, qweight, scales, z)
    return out[:m]


def _int8_kernel(x_ref, xs_ref, w_ref, ws_ref, o_ref, *, step: int):
    def body(i, acc):
        k0 = i * step
        a, b = x_ref[:, pl.ds(k0, step)], w_ref[pl.ds(k0, step), :]
        return acc + lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)

    acc = lax.fori_loop(0, x_ref.shape[1] // step, body, jnp.zeros(o_ref.shape, jnp.int32))
    out = acc.astype(jnp.float32) * xs_ref[...][:, None] * ws_ref[...].astype(jnp.float32)
    o_ref[...] = out.astype(o_ref.dtype)


def int8_matmul(
    xq: Int[Array, "M K"],
    x_scale: Float[Array, " M"],
    wq: Int[Array, "K N"],
    w_scale: Float[Array, " N"],
    *,
    out_dtype: jnp.dtype,
    tiles: MatmulTiles | None = None,
    interpret: bool | None = None,
) -> Float[Array, "M N"]:
    """W8A8: (xq @ wq in int32) * x_scale[:, None] * w_scale[None, :], in `out_dtype`."""
    m, k = xq.shape
    n = wq.shape[1]
    if wq.shape[0] != k:
        raise ValueError(f"xq has K={k} but wq has {wq.shape[0]} rows")
    tiles = tiles or default_tiles(m, n, k)
    _check(m, n, k, tiles)
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    bm, bn = tiles.block_m, tiles.block_n
    xp = _pad_rows(xq, bm)
    xs = jnp.pad(x_scale.astype(jnp.float32), (0, xp.shape[0] - m))
    out = pl.pallas_call(
        functools.partial(_int8_kernel, step=tiles.block_k),
        grid=(xp.shape[0] // bm, n // bn),
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
            pl.BlockSpec((bm,), lambda i, j: (i,)),
            pl.BlockSpec((k, bn), lambda i, j: (0, j)),
            pl.BlockSpec((1, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], n), out_dtype),
        name="jaxinfra_w8a8_matmul",
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
    )(xp, xs, wq, w_scale.reshape(1, n))
    return out[:m]
