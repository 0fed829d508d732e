"""Paged decode attention: one query token per sequence, split-K over long contexts.

The decode case of the ragged kernel (every sequence brings one new token); its split-K is on by
default so a batch of a few long sequences still spreads over the whole GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pallas_kernels.ragged_paged_attention import ragged_paged_attention

MIN_KEYS_PER_SPLIT = 512
H100_SMS = 132  # when the device does not say (off GPU: interpret mode)


def device_cores() -> int:
    """Streaming multiprocessors of the default device (its `core_count`), H100's when unknown."""
    return getattr(jax.devices()[0], "core_count", None) or H100_SMS


def default_num_splits(num_seqs: int, max_blocks: int, block_size: int) -> int:
    """Enough KV splits that (sequences x splits) fills the device's SMs, each split >= 512 keys."""
    max_by_length = max(1, max_blocks * block_size // MIN_KEYS_PER_SPLIT)
    wanted = pl.cdiv(device_cores(), max(num_seqs, 1))
    return int(max(1, min(wanted, max_by_length, 16)))


def paged_attention(
    q: Float[Array, "S H D"],
    k_pool: Float[Array, "NB BS KH D"],
    v_pool: Float[Array, "NB BS KH D"],
    block_tables: Int[Array, "S MB"],
    context_lens: Int[Array, " S"],
    *,
    num_splits: int | None = None,
    **kwargs,
) -> Float[Array, "S H D"]:
    """Attention of each sequence's single new query (at position context_len - 1) over its pages."""
    s, mb = block_tables.shape
    if num_splits is None:
        num_splits = default_num_splits(s, mb, k_pool.shape[1])
    cu = jnp.arange(s + 1, dtype=jnp.int32)
    return ragged_paged_attention(
        q, k_pool, v_pool, block_tables, cu, context_lens, max_q_len=1, num_splits=num_splits, **kwargs
    )
