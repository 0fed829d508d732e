"""Merge of split-K attention partials in Pallas (Triton lowering), beside its jax.numpy reference.

Split-K gives each KV split of a row its own normalised output and log-sum-exp (base 2); the merge
weights each split by exp2(lse - max lse) over the splits. One small kernel reads the float32
partials once and writes the result in the query dtype, instead of a chain of XLA reductions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

BLOCK_ROWS = 32  # rows (token x head) per program


def _merge_kernel(o_ref, lse_ref, out_ref, *, num_splits: int) -> None:
    rows, d = out_ref.shape
    r = pl.program_id(0) * BLOCK_ROWS + lax.broadcasted_iota(jnp.int32, (BLOCK_ROWS,), 0)
    valid = r < rows
    r = jnp.where(valid, r, rows)  # masked rows point past the array
    cols = lax.broadcasted_iota(jnp.int32, (pl.next_power_of_2(d),), 0)  # any head dim: padded, masked
    tile_mask = valid[:, None] & (cols < d)[None, :]
    lses = [plgpu.load(lse_ref.at[c, r], mask=valid, other=-jnp.inf) for c in range(num_splits)]
    top = lses[0]
    for lse in lses[1:]:
        top = jnp.maximum(top, lse)
    top = jnp.where(top == -jnp.inf, 0.0, top)  # a row no split saw: all weights 0, output 0
    acc = jnp.zeros((BLOCK_ROWS, cols.shape[0]), jnp.float32)
    total = jnp.zeros((BLOCK_ROWS,), jnp.float32)
    for c, lse in enumerate(lses):
        w = jnp.exp2(lse - top)
        part = plgpu.load(o_ref.at[c, r[:, None], cols[None, :]], mask=tile_mask, other=0.0)
        acc += w[:, None] * part
        total += w
    out = acc / jnp.where(total == 0.0, 1.0, total)[:, None]
    plgpu.store(out_ref.at[r[:, None], cols[None, :]], out.astype(out_ref.dtype), mask=tile_mask)


def merge_splits(
    o: Float[Array, "C R D"],
    lse: Float[Array, "C R"],
    dtype: jnp.dtype,
    *,
    interpret: bool | None = None,
) -> Float[Array, "R D"]:
    """Combine C split partials (outputs o, base-2 log-sum-exps lse; -inf where a split saw no key)."""
    c, rows, d = o.shape
    if lse.shape != (c, rows):
        raise ValueError(f"lse {lse.shape} does not match partials {o.shape}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    return pl.pallas_call(
        functools.partial(_merge_kernel, num_splits=c),
        grid=(pl.cdiv(rows, BLOCK_ROWS),),
        in_specs=[whole(o.shape), whole(lse.shape)],
        out_specs=whole((rows, d)),
        out_shape=jax.ShapeDtypeStruct((rows, d), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxinfra_merge_splits",
    )(o, lse)


def merge_splits_reference(o: Float[Array, "C R D"], lse: Float[Array, "C R"], dtype: jnp.dtype) -> Float[Array, "R D"]:
    """The same merge in jax.numpy."""
    top = jnp.max(lse, axis=0)
    w = jnp.exp2(lse - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(w, axis=0)
    return (jnp.sum(w[..., None] * o, axis=0) / jnp.where(total == 0, 1.0, total)[:, None]).astype(dtype)
