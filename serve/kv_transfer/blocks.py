"""Whole blocks in and out of a PagedKVCache: every layer, K, V and (int8/fp8) their scales.

The pools are [layers, blocks, block_size, kv_heads, head_dim] (scales without head_dim); a block is
the unit every transport moves, so a transfer is one gather on the source and one scatter on the
destination, with nothing converted on the way (the bytes arrive bitwise).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from pallas_kernels import PagedKVCache


def block_axis(pool: PagedKVCache) -> int:
    """The blocks axis: 1 behind a stacked layers axis, else 0."""
    return pool.k.ndim - 4


def pool_fields(pool: PagedKVCache) -> dict[str, jax.Array]:
    """The pool's arrays by field name (k, v and, when quantized, k_scale, v_scale)."""
    arrays = {"k": pool.k, "v": pool.v, "k_scale": pool.k_scale, "v_scale": pool.v_scale}
    return {name: a for name, a in arrays.items() if a is not None}


def padded_ids(ids: list[int]) -> np.ndarray:
    """`ids` padded to the next power of two by repeating the last one: the jitted gather and scatter
    compile once per power of two, not once per block count (a repeated block is written twice, the
    same bytes)."""
    n = 1 << max(len(ids) - 1, 0).bit_length()
    return np.asarray([*ids, *[ids[-1]] * (n - len(ids))], np.int32)


@jax.jit
def gather_blocks(pool: PagedKVCache, block_ids: Int[Array, " N"]) -> PagedKVCache:
    """The blocks `block_ids` of every array of `pool`, in that order (a PagedKVCache of N blocks)."""
    axis = block_axis(pool)
    return jax.tree.map(lambda a: jnp.take(a, block_ids, axis=axis), pool)


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_blocks(pool: PagedKVCache, block_ids: Int[Array, " N"], blocks: PagedKVCache) -> PagedKVCache:
    """`pool` with `blocks` written at `block_ids` (the pool donated: updated in place)."""
    index = (slice(None),) * block_axis(pool) + (block_ids,)
    return jax.tree.map(lambda a, b: a.at[index].set(b), pool, blocks)
