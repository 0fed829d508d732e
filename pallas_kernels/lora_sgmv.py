"""SGMV (Punica's segmented gather matrix-vector): multi-LoRA for prefill, in Pallas (Triton lowering).

Tokens come in contiguous segments that share an adapter slot (a prefill chunk per sequence):
segment g is tokens seg_starts[g] <= t < seg_starts[g + 1] with slot seg_slots[g] (-1: no adapter;
tokens past seg_starts[-1] get zero). Two kernels on tensor cores, each program a row tile that
walks the segments its rows span (their range computed once on device, as in grouped_matmul.py):
shrink multiplies the tile's rows of each segment, masked, by the segment's A over in_dim into a
float32 [block_m, R] tile; expand multiplies that (in x's dtype) by the segment's B for one block of
out columns and scales it. Loads are masked, so any in/out dim and rank (padded to a power of two,
at least 16 for the MMA) reads the pools in place. Backward as in lora_bgmv.py.
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

from pallas_kernels.lora_bgmv import pow2_at_least
from pallas_kernels.lora_reference import check_pools, check_segments, segment_slots
from pallas_kernels.lora_xla import pool_grads
from pallas_kernels.tile_ops import dot


@dataclasses.dataclass(frozen=True)
class SgmvTiles:
    """Row tile, shrink's in_dim step and expand's out-column block."""

    block_m: int = 64
    block_k: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2


def default_tiles(tokens: int, n_in: int, n_out: int) -> SgmvTiles:
    """16- to 64-row tiles (no more than the tokens need), 64-wide K steps, 128 out columns."""
    return SgmvTiles(min(64, pow2_at_least(tokens)), min(64, pow2_at_least(n_in)), min(128, pow2_at_least(n_out)))


def _iota(n: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


def _segment(off_ref, slot_ref, rows: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Segment g's slot (clamped to 0), whether it has an adapter, and which of `rows` it holds."""
    s = slot_ref[g]
    inside = (rows >= off_ref[g]) & (rows < off_ref[g + 1]) & (s >= 0)
    return jnp.maximum(s, 0), s >= 0, inside


def _shrink_kernel(first_ref, last_ref, off_ref, slot_ref, x_ref, a_ref, v_ref, *, rank: int, block_k: int):
    i = pl.program_id(0)
    n_in = x_ref.shape[1]
    bm, rank_p = v_ref.shape[0] // pl.num_programs(0), v_ref.shape[1]
    rows, r = i * bm + _iota(bm), _iota(rank_p)

    def segment(g, acc):
        s, on, inside = _segment(off_ref, slot_ref, rows, g)

        def k_step(kk, acc):
            k = kk * block_k + _iota(block_k)
            km = k < n_in
            x = plgpu.load(x_ref.at[rows[:, None], k[None, :]], mask=inside[:, None] & km[None, :], other=0)
            mask = (km & on)[:, None] & (r < rank)[None, :]
            a = plgpu.load(a_ref.at[(s * n_in + k)[:, None], r[None, :]], mask=mask, other=0)
            return acc + dot(x, a.astype(x.dtype))

        return lax.fori_loop(0, pl.cdiv(n_in, block_k), k_step, acc)

    acc = lax.fori_loop(first_ref[i], last_ref[i] + 1, segment, jnp.zeros((bm, rank_p), jnp.float32))
    plgpu.store(v_ref.at[rows[:, None], r[None, :]], acc)


def _expand_kernel(first_ref, last_ref, off_ref, slot_ref, scale_ref, v_ref, b_ref, o_ref, *, rank, bm, block_n):
    i, j = pl.program_id(0), pl.program_id(1)
    n_tok, n_out = o_ref.shape
    rows, r = i * bm + _iota(bm), _iota(v_ref.shape[1])
    cols = j * block_n + _iota(block_n)
    cm = cols < n_out

    def segment(g, acc):
        s, on, inside = _segment(off_ref, slot_ref, rows, g)
        v = plgpu.load(v_ref.at[rows[:, None], r[None, :]], mask=inside[:, None], other=0)
        mask = ((r < rank) & on)[:, None] & cm[None, :]
        b = plgpu.load(b_ref.at[(s * rank + r)[:, None], cols[None, :]], mask=mask, other=0)
        return acc + dot(v.astype(o_ref.dtype), b.astype(o_ref.dtype)) * scale_ref[s].astype(jnp.float32)

    acc = lax.fori_loop(first_ref[i], last_ref[i] + 1, segment, jnp.zeros((bm, block_n), jnp.float32))
    mask = (rows < n_tok)[:, None] & cm[None, :]
    plgpu.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype), mask=mask)


def _sgmv(x, seg_starts, seg_slots, a, b, scaling, tiles: SgmvTiles, interpret: bool) -> jax.Array:
    (t, n_in), (s, _, rank), n_out = x.shape, a.shape, b.shape[2]
    g, bm, rank_p = seg_slots.shape[0], tiles.block_m, pow2_at_least(rank)
    tiles_m = pl.cdiv(t, bm)
    offsets = jnp.minimum(seg_starts, t)
    starts = jnp.arange(0, tiles_m * bm, bm, dtype=jnp.int32)
    # the segments each row tile spans: the segment of its first row to the segment of its last row
    first = jnp.clip(jnp.searchsorted(offsets, starts, side="right") - 1, 0, g - 1).astype(jnp.int32)
    last = jnp.clip(jnp.searchsorted(offsets, starts + bm - 1, side="right") - 1, 0, g - 1).astype(jnp.int32)
    meta = (first, last, offsets, seg_slots)
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    params = plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    a2, b2 = a.reshape(s * n_in, rank), b.reshape(s * rank, n_out)
    v = pl.pallas_call(
        functools.partial(_shrink_kernel, rank=rank, block_k=tiles.block_k),
        grid=(tiles_m,),
        in_specs=[whole(m.shape) for m in meta] + [whole(x.shape), whole(a2.shape)],
        out_specs=whole((tiles_m * bm, rank_p)),
        out_shape=jax.ShapeDtypeStruct((tiles_m * bm, rank_p), jnp.float32),
        name="jaxinfra_lora_sgmv_shrink",
        compiler_params=params,
        interpret=interpret,
    )(*meta, x, a2)
    return pl.pallas_call(
        functools.partial(_expand_kernel, rank=rank, bm=bm, block_n=tiles.block_n),
        grid=(tiles_m, pl.cdiv(n_out, tiles.block_n)),
        in_specs=[whole(m.shape) for m in (*meta, scaling, v, b2)],
        out_specs=whole((t, n_out)),
        out_shape=jax.ShapeDtypeStruct((t, n_out), x.dtype),
        name="jaxinfra_lora_sgmv_expand",
        compiler_params=params,
        interpret=interpret,
    )(*meta, scaling, v, b2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _sgmv_diff(x, seg_starts, seg_slots, a, b, scaling, tiles: SgmvTiles, interpret: bool):
    return _sgmv(x, seg_starts, seg_slots, a, b, scaling, tiles, interpret)


def _sgmv_fwd(x, seg_starts, seg_slots, a, b, scaling, tiles, interpret):
    out = _sgmv(x, seg_starts, seg_slots, a, b, scaling, tiles, interpret)
    return out, (x, seg_starts, seg_slots, a, b, scaling)


def _sgmv_bwd(tiles, interpret, residuals, dy):
    x, seg_starts, seg_slots, a, b, scaling = residuals
    bt, at = jnp.swapaxes(b, 1, 2), jnp.swapaxes(a, 1, 2)
    back = default_tiles(x.shape[0], b.shape[2], a.shape[1])
    dx = _sgmv(dy.astype(x.dtype), seg_starts, seg_slots, bt, at, scaling, back, interpret)
    slots = segment_slots(seg_starts, seg_slots, x.shape[0])
    return (dx, None, None, *pool_grads(x, slots, a, b, scaling, dy))


_sgmv_diff.defvjp(_sgmv_fwd, _sgmv_bwd)


def sgmv_pallas(
    x: Float[Array, "T IN"],
    seg_starts: Int[Array, " G1"],
    seg_slots: Int[Array, " G"],
    a: Float[Array, "S IN R"],
    b: Float[Array, "S R OUT"],
    scaling: Float[Array, " S"],
    *,
    tiles: SgmvTiles | None = None,
    interpret: bool | None = None,
) -> Float[Array, "T OUT"]:
    """scaling[s] * (x[t] @ A[s]) @ B[s] for the tokens t of each segment (slot s = seg_slots[g]; -1
    and tokens past seg_starts[-1]: zero), in x's dtype: the prefill kernels, differentiable in x, A,
    B and scaling. seg_starts must be non-decreasing."""
    check_pools(x, a, b, scaling)
    check_segments(seg_starts, seg_slots)
    tiles = tiles or default_tiles(x.shape[0], a.shape[1], b.shape[2])
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    starts, slots = seg_starts.astype(jnp.int32), seg_slots.astype(jnp.int32)
    return _sgmv_diff(x, starts, slots, a, b, scaling, tiles, interpret)
