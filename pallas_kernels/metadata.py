"""Attention metadata pytrees: they tell the attention layer where its keys and values are."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseMetadata:
    """Self-attention over the tokens of this call (training, full prefill, packed rows).

    `segment_ids` [B, T] keeps packed documents apart; `causal` is static.
    """

    segment_ids: Int[Array, "B T"] | None = None
    causal: bool = dataclasses.field(default=True, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContiguousCacheMetadata:
    """New tokens written into a per-sequence contiguous cache at their absolute `positions`.

    A query at position p sees cache slots 0..p of its own row (the reference generator's layout).
    """

    positions: Int[Array, "B T"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """One layer's contiguous K/V cache, [B, max_len, num_kv_heads, head_dim] each."""

    k: Float[Array, "B S KH D"]
    v: Float[Array, "B S KH D"]

    @classmethod
    def zeros(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: jnp.dtype) -> "KVCache":
        shape = (batch, max_len, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


AttentionMetadata = DenseMetadata | ContiguousCacheMetadata
