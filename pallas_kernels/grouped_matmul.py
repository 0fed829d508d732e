"""Grouped (ragged per-expert) matmul in Pallas (Triton lowering), beside grouped_matmul_reference.py.

Rows arrive sorted by group (an MoE layer's token copies sorted by expert). Forward: each program
owns a [block_m, block_n] output tile and walks the groups its rows span (their range comes from
the group offsets, computed once on device), multiplying the tile's rows of each group, masked, by
that group's weight over K; the tile is stored once, so no two programs write the same rows.
Backward: the input gradient is the same kernel against the transposed weights; the weight
gradient (`tgmm`) gives each program one group's [block_k, block_n] tile and walks that group's
rows. Rows past sum(group_sizes) get zeros, as in jax.lax.ragged_dot.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.grouped_matmul_reference import grouped_matmul_reference
from pallas_kernels.tile_ops import dot

IMPLS = ("pallas", "reference")


@dataclasses.dataclass(frozen=True)
class GroupedTiles:
    """Row tile, output-column tile and K step (the weight gradient tiles K by block_k too)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 2


def default_tiles(k: int, n: int) -> GroupedTiles:
    """The largest power-of-two tiles (up to 128 columns, 64 K) that divide N and K."""
    if n % 16 or k % 16:
        raise ValueError(f"the Pallas grouped matmul needs K and N multiples of 16, got K={k}, N={n}")
    block_n = next(b for b in (128, 64, 32, 16) if n % b == 0)
    block_k = next(b for b in (64, 32, 16) if k % b == 0)
    return GroupedTiles(64, block_n, block_k, num_warps=4 if block_n <= 64 else 8)


def _offsets(group_sizes: jax.Array) -> jax.Array:
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes.astype(jnp.int32))])


def _scalar(ref: jax.Array, i: jax.Array) -> jax.Array:
    return ref[i]


def _gmm_kernel(first_ref, last_ref, off_ref, x_ref, w_ref, o_ref, *, block_k: int):
    i = pl.program_id(0)
    bm = x_ref.shape[0]
    rows = i * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)

    def group(g, acc):
        inside = (rows >= _scalar(off_ref, g)) & (rows < _scalar(off_ref, g + 1))

        def k_step(kk, acc):
            k0 = kk * block_k
            x = jnp.where(inside, x_ref[:, pl.ds(k0, block_k)], 0).astype(x_ref.dtype)
            return acc + dot(x, w_ref[g, pl.ds(k0, block_k), :])

        return lax.fori_loop(0, x_ref.shape[1] // block_k, k_step, acc)

    acc = lax.fori_loop(_scalar(first_ref, i), _scalar(last_ref, i) + 1, group, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tiles: GroupedTiles, interpret: bool) -> jax.Array:
    m, k = lhs.shape
    g, _, n = rhs.shape
    bm, bn = tiles.block_m, tiles.block_n
    mp = -(-max(m, 1) // bm) * bm
    xp = jnp.pad(lhs, ((0, mp - m), (0, 0)))
    offsets = _offsets(group_sizes)
    starts = jnp.arange(0, mp, bm, dtype=jnp.int32)
    # the groups each row tile spans: the group of its first row to the group of its last row
    first = jnp.clip(jnp.searchsorted(offsets, starts, side="right") - 1, 0, g - 1).astype(jnp.int32)
    last = jnp.clip(jnp.searchsorted(offsets, starts + bm - 1, side="right") - 1, 0, g - 1).astype(jnp.int32)
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, block_k=tiles.block_k),
        grid=(mp // bm, n // bn),
        in_specs=[
            pl.BlockSpec(first.shape, lambda i, j: (0,)),
            pl.BlockSpec(last.shape, lambda i, j: (0,)),
            pl.BlockSpec(offsets.shape, lambda i, j: (0,)),
            pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
            pl.BlockSpec((g, k, bn), lambda i, j: (0, 0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, n), lhs.dtype),
        name="jaxinfra_grouped_matmul",
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
    )(first, last, offsets, xp, rhs)
    return out[:m]


def _tgmm_kernel(off_ref, x_ref, dy_ref, o_ref, *, block_m: int):
    g = pl.program_id(0)
    start, end = _scalar(off_ref, g), _scalar(off_ref, g + 1)

    def row_step(t, acc):
        r0 = start + t * block_m
        rows = r0 + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
        x = jnp.where(rows < end, x_ref[pl.ds(r0, block_m), :], 0).astype(x_ref.dtype)
        return acc + dot(x, dy_ref[pl.ds(r0, block_m), :], trans_a=True)

    steps = (end - start + block_m - 1) // block_m
    o_ref[...] = lax.fori_loop(0, steps, row_step, jnp.zeros(o_ref.shape[1:], jnp.float32))[None].astype(o_ref.dtype)


def _tgmm(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, tiles: GroupedTiles, interpret: bool) -> jax.Array:
    """d rhs[g] = lhs[rows of g]^T @ dout[rows of g], for every group."""
    m, k = lhs.shape
    n = dout.shape[1]
    g = group_sizes.shape[0]
    bm, bk, bn = tiles.block_m, tiles.block_k, tiles.block_n
    xp = jnp.pad(lhs, ((0, bm), (0, 0)))  # a group's last row tile may read past M
    dyp = jnp.pad(dout, ((0, bm), (0, 0)))
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, block_m=bm),
        grid=(g, k // bk, n // bn),
        in_specs=[
            pl.BlockSpec((g + 1,), lambda e, i, j: (0,)),
            pl.BlockSpec((m + bm, bk), lambda e, i, j: (0, i)),
            pl.BlockSpec((m + bm, bn), lambda e, i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((1, bk, bn), lambda e, i, j: (e, i, j)),
        out_shape=jax.ShapeDtypeStruct((g, k, n), lhs.dtype),
        name="jaxinfra_grouped_matmul_dw",
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
    )(_offsets(group_sizes), xp, dyp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tiles: GroupedTiles, interpret: bool) -> jax.Array:
    return _gmm(lhs, rhs, group_sizes, tiles, interpret)


def _grouped_fwd(lhs, rhs, group_sizes, tiles, interpret):
    return _gmm(lhs, rhs, group_sizes, tiles, interpret), (lhs, rhs, group_sizes)


def _grouped_bwd(tiles, interpret, residuals, dout):
    lhs, rhs, group_sizes = residuals
    k, n = rhs.shape[1:]
    dout = dout.astype(lhs.dtype)
    dlhs = _gmm(dout, jnp.swapaxes(rhs, 1, 2), group_sizes, default_tiles(n, k), interpret)
    drhs = _tgmm(lhs, dout, group_sizes, tiles, interpret)
    return dlhs, drhs.astype(rhs.dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul_pallas(
    lhs: Float[Array, "M K"],
    rhs: Float[Array, "G K N"],
    group_sizes: Int[Array, " G"],
    *,
    tiles: GroupedTiles | None = None,
    interpret: bool | None = None,
) -> Float[Array, "M N"]:
    """Our kernel: out[r] = lhs[r] @ rhs[g] for the rows r of group g, differentiable in lhs and rhs."""
    if lhs.shape[1] != rhs.shape[1] or group_sizes.shape != rhs.shape[:1]:
        raise ValueError(f"grouped_matmul: lhs {lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape}")
    tiles = tiles or default_tiles(rhs.shape[1], rhs.shape[2])
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    return _grouped(lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32), tiles, interpret)


def grouped_matmul(
    lhs: Float[Array, "M K"], rhs: Float[Array, "G K N"], group_sizes: Int[Array, " G"], impl: str | None = None
) -> Float[Array, "M N"]:
    """Per-group matmul of rows sorted by group: our Pallas kernel on GPU (when K and N are multiples
    of 16), jax.lax.ragged_dot elsewhere; `impl` ("pallas", "reference") forces one."""
    if impl is None:
        fits = rhs.shape[1] % 16 == 0 and rhs.shape[2] % 16 == 0
        impl = "pallas" if jax.default_backend() == "gpu" and fits else "reference"
    if impl not in IMPLS:
        raise ValueError(f"grouped_matmul impl must be one of {IMPLS}, got {impl!r}")
    if impl == "pallas":
        return grouped_matmul_pallas(lhs, rhs, group_sizes)
    return grouped_matmul_reference(lhs, rhs, group_sizes)
