"""Attention on a sharded mesh. XLA partitions jnp code itself; our Pallas kernels are opaque to
it (it would gather their sharded inputs and compute them whole on every device), so they run per
device under shard_map.

Whole rows (training, scoring), with the flash kernel: batch over the data axes, heads over the
tensor axis, and with the sequence split over the context axis, each device's queries against the
whole (all-gathered) sequence of keys. The kernel aligns queries to the end of the keys; a device holding query chunk i
of C therefore sees the keys rotated so that key (i + 1) x chunk - 1 comes last, with the rotated-in
future keys masked through their segment ids. Every device then scans all T keys (no causal
skipping across chunks): exact, at up to twice the ideal attention FLOPs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import (
    AttentionMetadata,
    KVCache,
    PagedKVCache,
    attend,
    default_impl,
    dot_product_attention,
    flash_attention,
)
from sharding import mesh_axis, per_device

_MASKED = -1  # segment id of rotated-in future keys (real segment ids are >= 0)


def dense_attention(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B T KH D"],
    v: Float[Array, "B T KH D"],
    segment_ids: Int[Array, "B T"] | None,
    *,
    causal: bool,
    sliding_window: int | None,
    logit_softcap: float | None,
    impl: str | None,
) -> Float[Array, "B T H D"]:
    """Causal (or full) self-attention of a row's queries to its keys, packed segments kept apart."""
    impl = impl or default_impl()
    common: dict[str, Any] = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
    if impl != "pallas":
        return dot_product_attention(
            q, k, v, causal=causal, q_segment_ids=segment_ids, kv_segment_ids=segment_ids, impl=impl, **common
        )
    b, t = q.shape[:2]
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    context_axes = mesh_axis("length")

    def local(q: jax.Array, k: jax.Array, v: jax.Array, q_seg: jax.Array, kv_seg: jax.Array) -> jax.Array:
        chunk, total = q.shape[1], k.shape[1]
        if not (causal and chunk < total and context_axes is not None):
            if segment_ids is None:
                return flash_attention(q, k, v, causal=causal, **common)
            return flash_attention(q, k, v, causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg, **common)
        shift = total - (jax.lax.axis_index(context_axes) + 1) * chunk  # rotate key (i+1) x chunk - 1 last
        k, v, kv_seg = (jnp.roll(x, shift, axis=1) for x in (k, v, kv_seg))
        kv_seg = jnp.where(jnp.arange(total)[None, :] < shift, _MASKED, kv_seg)
        return flash_attention(q, k, v, causal=True, q_segment_ids=q_seg, kv_segment_ids=kv_seg, **common)

    rows = ("batch", "length", "heads", "head_dim")
    keys = ("batch", None, "kv_heads", "head_dim")
    return per_device(local, (q, k, v, seg, seg), (rows, keys, keys, ("batch", "length"), ("batch", None)))


def cached_attention(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B T KH D"],
    v: Float[Array, "B T KH D"],
    metadata: AttentionMetadata,
    cache: KVCache | PagedKVCache,
    *,
    impl: str | None,
    **options: Any,
) -> tuple[Float[Array, "B T H D"], KVCache | PagedKVCache]:
    """`attend` with a KV cache (serving): under tensor parallelism each device writes and reads its
    own KV heads' pools with its query heads; the metadata (block tables, lengths) is replicated."""

    def local(q: jax.Array, k: jax.Array, v: jax.Array, cache: Any, metadata: Any) -> tuple[jax.Array, Any]:
        out, new_cache = attend(q, k, v, metadata, cache, impl=impl, **options)
        return out, new_cache

    rows = ("batch", "length", "heads", "head_dim")
    new_kv = ("batch", "length", "kv_heads", "head_dim")

    def pool(x: jax.Array) -> tuple[str | None, ...]:  # [blocks, block size, KV heads, D] and scales
        return (None, None, "kv_heads", "head_dim")[: x.ndim]

    def replicated(x: jax.Array) -> tuple[None, ...]:
        return (None,) * x.ndim

    return per_device(local, (q, k, v, cache, metadata), (rows, new_kv, new_kv, pool, replicated), out=(0, 3))
