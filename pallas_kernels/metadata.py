"""Attention metadata pytrees: they tell the attention layer where its keys and values are."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.kv_quant import is_quantized_kv, quantize
from pallas_kernels.paged_tiles import TilePlan


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
    def zeros(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: jnp.dtype) -> KVCache:
        shape = (batch, max_len, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedMetadata:
    """A flat ragged token batch over a paged KV pool (serving).

    Sequence s brings new tokens cu_q_lens[s]:cu_q_lens[s+1] and has kv_lens[s] keys including them;
    its pages are block_tables[s]. slot_mapping[n] = block * block_size + offset where token n's K/V
    go (-1 for padding tokens). `max_q_len` (static) bounds any sequence's new tokens. Work tiles
    built on the host spare the kernels their index work: `plan` (`tile_plan`) for the XLA
    implementation, `work` (`kernel_work_list`) for the Pallas kernel.
    """

    slot_mapping: Int[Array, " N"]
    block_tables: Int[Array, "S MB"]
    cu_q_lens: Int[Array, " S1"]
    kv_lens: Int[Array, " S"]
    max_q_len: int | None = dataclasses.field(default=None, metadata={"static": True})
    plan: TilePlan | None = None
    work: Int[Array, "T 2"] | None = None

    def query_slice(self, start: Int[Array, ""] | int, size: int) -> PagedMetadata:
        """The flat batch's tokens start:start + size as the queries, every token's K/V still written
        (slot_mapping whole; context parallelism): each sequence's queries clipped to the slice and its
        keys ending at its last query there, so the causal mask stays by absolute position. The host's
        plan and work list are the whole batch's: dropped, the kernels build the slice's on device."""
        cu = jnp.clip(self.cu_q_lens - start, 0, size)
        q_lens = cu[1:] - cu[:-1]
        past = jnp.maximum(self.cu_q_lens[1:] - (start + size), 0)  # each sequence's tokens after the slice
        kv_lens = jnp.where(q_lens > 0, self.kv_lens - past, 0)
        return dataclasses.replace(self, cu_q_lens=cu, kv_lens=kv_lens, plan=None, work=None)


def _scatter_slots(pool: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    flat = pool.reshape(-1, *pool.shape[2:])
    slots = jnp.where(slots < 0, flat.shape[0], slots)  # padding -> out of range -> dropped
    if slots.shape[0] == 1:
        # XLA turns a one-index scatter into a select over a dynamic-update-slice of the whole pool,
        # which it cannot do in place outside a loop (a copy of the pool per layer); a second,
        # dropped index keeps it a scatter.
        slots = jnp.concatenate([slots, jnp.full((1,), flat.shape[0], slots.dtype)])
        new = jnp.concatenate([new, jnp.zeros_like(new)])
    return flat.at[slots].set(new.astype(pool.dtype), mode="drop").reshape(pool.shape)


BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128)  # tokens per KV block the paged kernels support


def kv_bytes_per_element(dtype: jnp.dtype | str, head_dim: int) -> float:
    """Pool bytes per stored K or V element: int8/fp8 values carry a float32 scale per token and head."""
    if is_quantized_kv(dtype):
        return 1 + 4 / head_dim
    return jnp.dtype(dtype).itemsize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """One layer's paged K/V pools [num_blocks, block_size, num_kv_heads, head_dim].

    int8 and fp8 pools carry per-token, per-head float32 scales [num_blocks, block_size, num_kv_heads].
    """

    k: Float[Array, "NB BS KH D"]
    v: Float[Array, "NB BS KH D"]
    k_scale: Float[Array, "NB BS KH"] | None = None
    v_scale: Float[Array, "NB BS KH"] | None = None

    @classmethod
    def zeros(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype,
        num_layers: int | None = None,
    ) -> PagedKVCache:
        """Zeroed pools; with `num_layers`, every layer's pools stacked on a leading `layers` axis."""
        shape = (*(() if num_layers is None else (num_layers,)), num_blocks, block_size, num_kv_heads, head_dim)
        if is_quantized_kv(dtype):
            # two buffers: the engine donates the pools, and one buffer may not be donated twice
            return cls(
                jnp.zeros(shape, dtype),
                jnp.zeros(shape, dtype),
                jnp.ones(shape[:-1], jnp.float32),
                jnp.ones(shape[:-1], jnp.float32),
            )
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def write(self, k: Float[Array, "N KH D"], v: Float[Array, "N KH D"], slots: Int[Array, " N"]) -> PagedKVCache:
        """Scatter new K/V into their slots (jit with the cache donated: updated in place)."""
        if self.k_scale is None or self.v_scale is None:
            return PagedKVCache(_scatter_slots(self.k, k, slots), _scatter_slots(self.v, v, slots))
        (kq, ks), (vq, vs) = quantize(k, self.k.dtype), quantize(v, self.v.dtype)
        return PagedKVCache(
            _scatter_slots(self.k, kq, slots),
            _scatter_slots(self.v, vq, slots),
            _scatter_slots(self.k_scale, ks, slots),
            _scatter_slots(self.v_scale, vs, slots),
        )


AttentionMetadata = DenseMetadata | ContiguousCacheMetadata | PagedMetadata
