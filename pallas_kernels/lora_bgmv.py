"""BGMV (Punica's batched gather matrix-vector): multi-LoRA for decode, in Pallas (Triton lowering).

Every token may use a different adapter slot (lora_reference.py has the pool layout). Two kernels,
as in Punica: shrink, one program per (token, split of in_dim), gathers its slot's A rows and
reduces x[t] * A[s] to a [R] partial (float32; the splits, which fill the GPU when a decode batch
has few tokens, are summed by XLA); expand, one program per (token, block of out columns), gathers
B[s]'s columns and writes scaling[s] * v[t] @ B[s]. A token's vector is too thin for tensor cores,
so both are elementwise products and reductions, bound by reading A[s] and B[s]. Loads are masked
(any in/out dim, ranks padded to a power of two, slot -1 reads nothing), so pools are never copied.
Backward: the input gradient is the same two kernels over the transposed pools; the pools' and
scaling's gradients come from the XLA formulation (lora_xla.pool_grads).
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

from pallas_kernels.lora_reference import check_pools, check_slots
from pallas_kernels.lora_xla import pool_grads
from pallas_kernels.quant_matmul import SM_COUNT

STEP_ELEMENTS = 4096  # products one program step forms: past this, rank 64 reached 162 registers


@dataclasses.dataclass(frozen=True)
class BgmvTiles:
    """Shrink's in_dim step and split count, expand's out-column block."""

    block_k: int = 256
    block_n: int = 256
    num_splits: int = 1
    num_warps: int = 4


def pow2_at_least(n: int, least: int = 16) -> int:
    """The smallest power of two >= max(n, least): Triton blocks are powers of two."""
    return max(least, 1 << max(0, n - 1).bit_length())


def default_tiles(tokens: int, n_in: int, n_out: int, rank: int) -> BgmvTiles:
    """Steps and column blocks of up to 4096 products (256 x rank 16; fewer columns at larger ranks,
    32 float32 values per thread of 4 warps); in_dim split so tokens x splits reach 2 * SM_COUNT."""
    width = min(256, STEP_ELEMENTS // pow2_at_least(rank))
    block_k = min(width, pow2_at_least(n_in))
    steps = pl.cdiv(n_in, block_k)
    splits = max(1, min(steps, 2 * SM_COUNT // max(tokens, 1)))
    return BgmvTiles(block_k, min(width, pow2_at_least(n_out)), splits)


def _iota(n: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


def _shrink_kernel(slot_ref, x_ref, a_ref, v_ref, *, rank: int, block_k: int, steps: int):
    """v[split, t] = x[t, this split's columns] @ A[slots[t]] over them, float32 [rank_p]."""
    t, c = pl.program_id(0), pl.program_id(1)
    n_tok, n_in = x_ref.shape
    s = slot_ref[t]
    on = s >= 0
    base = jnp.maximum(s, 0) * n_in  # A is [S * in, R]: this slot's first row
    r = _iota(v_ref.shape[1])

    def step(kk, acc):
        k = (c * steps + kk) * block_k + _iota(block_k)
        km = k < n_in
        x = plgpu.load(x_ref.at[t + 0 * k, k], mask=km, other=0).astype(jnp.float32)
        mask = (km & on)[:, None] & (r < rank)[None, :]
        a = plgpu.load(a_ref.at[(base + k)[:, None], r[None, :]], mask=mask, other=0).astype(jnp.float32)
        return acc + jnp.sum(x[:, None] * a, axis=0)

    acc = lax.fori_loop(0, steps, step, jnp.zeros(r.shape, jnp.float32))
    plgpu.store(v_ref.at[c * n_tok + t + 0 * r, r], acc)


def _expand_kernel(slot_ref, scale_ref, v_ref, b_ref, o_ref, *, rank: int, block_n: int):
    """out[t, this block's columns] = scaling[s] * v[t] @ B[s] with s = slots[t]."""
    t, j = pl.program_id(0), pl.program_id(1)
    n_out = o_ref.shape[1]
    s = slot_ref[t]
    on = s >= 0
    sc = jnp.maximum(s, 0)
    r = _iota(v_ref.shape[1])
    cols = j * block_n + _iota(block_n)
    cm = cols < n_out
    v = plgpu.load(v_ref.at[t + 0 * r, r])
    mask = ((r < rank) & on)[:, None] & cm[None, :]
    b = plgpu.load(b_ref.at[(sc * rank + r)[:, None], cols[None, :]], mask=mask, other=0).astype(jnp.float32)
    y = jnp.sum(v[:, None] * b, axis=0) * scale_ref[sc].astype(jnp.float32)
    plgpu.store(o_ref.at[t + 0 * cols, cols], y.astype(o_ref.dtype), mask=cm)


def _params(tiles: BgmvTiles) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=2)


def _bgmv(
    x: jax.Array, slots: jax.Array, a: jax.Array, b: jax.Array, scaling: jax.Array, tiles: BgmvTiles, interpret: bool
) -> jax.Array:
    (t, n_in), (s, _, rank), n_out = x.shape, a.shape, b.shape[2]
    rank_p, splits = pow2_at_least(rank), tiles.num_splits
    steps = pl.cdiv(pl.cdiv(n_in, tiles.block_k), splits)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))
    a2, b2 = a.reshape(s * n_in, rank), b.reshape(s * rank, n_out)
    v = pl.pallas_call(
        functools.partial(_shrink_kernel, rank=rank, block_k=tiles.block_k, steps=steps),
        grid=(t, splits),
        in_specs=[whole(slots.shape), whole(x.shape), whole(a2.shape)],
        out_specs=whole((splits * t, rank_p)),
        out_shape=jax.ShapeDtypeStruct((splits * t, rank_p), jnp.float32),
        name="jaxinfra_lora_bgmv_shrink",
        compiler_params=_params(tiles),
        interpret=interpret,
    )(slots, x, a2)
    v = v.reshape(splits, t, rank_p).sum(axis=0)
    return pl.pallas_call(
        functools.partial(_expand_kernel, rank=rank, block_n=tiles.block_n),
        grid=(t, pl.cdiv(n_out, tiles.block_n)),
        in_specs=[whole(slots.shape), whole(scaling.shape), whole(v.shape), whole(b2.shape)],
        out_specs=whole((t, n_out)),
        out_shape=jax.ShapeDtypeStruct((t, n_out), x.dtype),
        name="jaxinfra_lora_bgmv_expand",
        compiler_params=_params(tiles),
        interpret=interpret,
    )(slots, scaling, v, b2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _bgmv_diff(x, slots, a, b, scaling, tiles: BgmvTiles, interpret: bool):
    return _bgmv(x, slots, a, b, scaling, tiles, interpret)


def _bgmv_fwd(x, slots, a, b, scaling, tiles, interpret):
    return _bgmv(x, slots, a, b, scaling, tiles, interpret), (x, slots, a, b, scaling)


def _bgmv_bwd(tiles, interpret, residuals, dy):
    x, slots, a, b, scaling = residuals
    n_out, n_in = b.shape[2], a.shape[1]
    back = default_tiles(x.shape[0], n_out, n_in, a.shape[2])
    dx = _bgmv(dy.astype(x.dtype), slots, jnp.swapaxes(b, 1, 2), jnp.swapaxes(a, 1, 2), scaling, back, interpret)
    return (dx, None, *pool_grads(x, slots, a, b, scaling, dy))


_bgmv_diff.defvjp(_bgmv_fwd, _bgmv_bwd)


def bgmv_pallas(
    x: Float[Array, "T IN"],
    slots: Int[Array, " T"],
    a: Float[Array, "S IN R"],
    b: Float[Array, "S R OUT"],
    scaling: Float[Array, " S"],
    *,
    tiles: BgmvTiles | None = None,
    interpret: bool | None = None,
) -> Float[Array, "T OUT"]:
    """scaling[s] * (x[t] @ A[s]) @ B[s] per token, s = slots[t] (-1: zero), in x's dtype: the
    decode kernels, differentiable in x, A, B and scaling."""
    check_pools(x, a, b, scaling)
    check_slots(x, slots)
    tiles = tiles or default_tiles(x.shape[0], a.shape[1], b.shape[2], a.shape[2])
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    return _bgmv_diff(x, slots.astype(jnp.int32), a, b, scaling, tiles, interpret)
