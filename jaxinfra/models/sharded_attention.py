"""Attention on a sharded mesh. XLA partitions jnp code itself; our Pallas kernels are opaque to
it (it would gather their sharded inputs and compute them whole on every device), so they run per
device under shard_map.

Whole rows (training, scoring), with the flash kernel: batch over the data axes, heads over the
tensor axis, and with the sequence split over the context axis, each device's queries against the
whole (all-gathered) sequence of keys at their own positions (the kernel's query offset, so tiles
past the diagonal are skipped). With `zigzag` the rows arrive reordered so that device i of
C holds chunks i and 2C - 1 - i of 2C (`zigzag_order`): every device then has the same causal work.

Serving's flat token batch over a paged cache, the same way: with the batch split over the context
axis, each device writes every (all-gathered) new key to its replica of the pools and attends its own
queries (`PagedMetadata.query_slice`: their positions, so the causal mask, stay absolute).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels import (
    AttentionMetadata,
    KVCache,
    PagedKVCache,
    PagedMetadata,
    attend,
    default_impl,
    dot_product_attention,
    flash_attention,
)
from sharding import per_device, sharded_axes


def zigzag_order(length: int, parts: int) -> np.ndarray:
    """Token order for `parts` devices: the sequence in 2 x parts chunks, device i (positions
    i x length / parts ...) taking chunks i and 2 parts - 1 - i, so causal attention costs each the same."""
    if length % (2 * parts):
        raise ValueError(f"sequence length {length} does not split into 2 x {parts} chunks (context parallelism)")
    chunks = np.arange(length).reshape(2 * parts, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * parts - 1 - i]]) for i in range(parts)])


def dense_attention(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B T KH D"],
    v: Float[Array, "B T KH D"],
    segment_ids: Int[Array, "B T"] | None,
    *,
    causal: bool,
    zigzag: bool,
    sliding_window: int | None,
    logit_softcap: float | None,
    impl: str | None,
) -> Float[Array, "B T H D"]:
    """Causal (or full) self-attention of a row's queries to its keys, packed segments kept apart;
    `zigzag`: rows split over the context axis are in `zigzag_order` (the caller reordered them)."""
    impl = impl or default_impl()
    common: dict[str, Any] = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
    if impl != "pallas":
        return dot_product_attention(
            q, k, v, causal=causal, q_segment_ids=segment_ids, kv_segment_ids=segment_ids, impl=impl, **common
        )
    b, t = q.shape[:2]
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    context_axes = sharded_axes("length", t)[0]

    def flash(q: jax.Array, k: jax.Array, v: jax.Array, q_seg: jax.Array, kv_seg: jax.Array, **kw: Any) -> jax.Array:
        if segment_ids is None:
            return flash_attention(q, k, v, causal=causal, **common, **kw)
        return flash_attention(q, k, v, causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg, **common, **kw)

    def local(q: jax.Array, k: jax.Array, v: jax.Array, q_seg: jax.Array, kv_seg: jax.Array) -> jax.Array:
        chunk, total = q.shape[1], k.shape[1]
        if not (causal and context_axes):
            return flash(q, k, v, q_seg, kv_seg)
        i = jax.lax.axis_index(context_axes)
        if not zigzag:
            return flash(q, k, v, q_seg, kv_seg, q_offset=i * chunk)
        back = np.argsort(zigzag_order(total, total // chunk))  # gathered keys -> sequence order
        k, v, kv_seg = (x[:, back] for x in (k, v, kv_seg))
        half, last = chunk // 2, 2 * (total // chunk) - 1
        first = flash(q[:, :half], k, v, q_seg[:, :half], kv_seg, q_offset=i * half)
        second = flash(q[:, half:], k, v, q_seg[:, half:], kv_seg, q_offset=(last - i) * half)
        return jnp.concatenate([first, second], axis=1)

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
    own KV heads' pools with its query heads; the metadata (block tables, lengths) is replicated.
    With the tokens split over the context axis (paged metadata only), each device's queries are
    its slice of the flat batch and the keys the whole batch's (context parallelism)."""
    context_axes, parts = sharded_axes("length", q.shape[1])
    if parts > 1 and not isinstance(metadata, PagedMetadata):
        raise ValueError("a KV cache split over the context axis needs PagedMetadata (serving's flat batch)")

    def local(q: jax.Array, k: jax.Array, v: jax.Array, cache: Any, metadata: Any) -> tuple[jax.Array, Any]:
        if parts > 1:  # serving's flat batch is one row: this device's tokens are one slice of it
            chunk = q.shape[1]
            metadata = metadata.query_slice(jax.lax.axis_index(context_axes) * chunk, chunk)
        out, new_cache = attend(q, k, v, metadata, cache, impl=impl, **options)
        return out, new_cache

    rows = ("batch", "length", "heads", "head_dim")
    new_kv = ("batch", None, "kv_heads", "head_dim")  # every new key on each device (gathered over context)

    def pool(x: jax.Array) -> tuple[str | None, ...]:  # [blocks, block size, KV heads, D] and scales
        return (None, None, "kv_heads", "head_dim")[: x.ndim]

    def replicated(x: jax.Array) -> tuple[None, ...]:
        return (None,) * x.ndim

    return per_device(local, (q, k, v, cache, metadata), (rows, new_kv, new_kv, pool, replicated), out=(0, 3))
