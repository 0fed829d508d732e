"""Plain jnp references for paged attention: gather each sequence's blocks, then plain attention."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.attention_reference import mha_reference
from pallas_kernels.kv_quant import dequantize
from pallas_kernels.paged_tiles import token_sequences


def gather_kv(pool: Float[Array, "NB BS KH D"], block_tables: Int[Array, "S MB"]) -> Float[Array, "S L KH D"]:
    """Each sequence's blocks, in order, as one contiguous [MB * BS] sequence."""
    s, mb = block_tables.shape
    blocks = jnp.take(pool, block_tables.reshape(-1), axis=0)
    return blocks.reshape(s, mb * pool.shape[1], *pool.shape[2:])


def ragged_paged_attention_reference(
    q: Float[Array, "N H D"],
    k_pool: Float[Array, "NB BS KH D"],
    v_pool: Float[Array, "NB BS KH D"],
    block_tables: Int[Array, "S MB"],
    cu_q_lens: Int[Array, " S1"],
    kv_lens: Int[Array, " S"],
    *,
    k_scales: Float[Array, "NB BS KH"] | None = None,
    v_scales: Float[Array, "NB BS KH"] | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    max_q_len: int | None = None,
) -> Float[Array, "N H D"]:
    """Sequence s owns new tokens cu_q_lens[s]:cu_q_lens[s+1] of the flat batch and kv_lens[s] keys
    (new ones included); its new token i sees key positions <= kv_len - q_len + i. Tokens past
    cu_q_lens[-1] are padding and return zeros. `max_q_len` (static) bounds any sequence's q_len.
    """
    n = q.shape[0]
    s = block_tables.shape[0]
    width = n if max_q_len is None else max_q_len
    k = gather_kv(dequantize(k_pool, k_scales, q.dtype), block_tables)
    v = gather_kv(dequantize(v_pool, v_scales, q.dtype), block_tables)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    i = jnp.arange(width)
    q_valid = i[None, :] < q_lens[:, None]
    rows = jnp.clip(cu_q_lens[:-1, None] + i[None, :], 0, n - 1)
    qs = jnp.where(q_valid[..., None, None], q[rows], 0)
    q_pos = kv_lens[:, None] - q_lens[:, None] + i[None, :]
    kv_pos = jnp.broadcast_to(jnp.arange(k.shape[1]), (s, k.shape[1]))
    out = mha_reference(
        qs,
        k,
        v,
        causal=True,
        q_positions=q_pos,
        kv_positions=kv_pos,
        q_segment_ids=q_valid.astype(jnp.int32),
        kv_segment_ids=jnp.where(kv_pos < kv_lens[:, None], 1, -1),
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        scale=scale,
    )
    seq, local, real = token_sequences(cu_q_lens, n)
    valid = real & (local < width)
    return jnp.where(valid[:, None, None], out[seq, jnp.clip(local, 0, width - 1)], 0).astype(q.dtype)


def paged_attention_reference(
    q: Float[Array, "S H D"],
    k_pool: Float[Array, "NB BS KH D"],
    v_pool: Float[Array, "NB BS KH D"],
    block_tables: Int[Array, "S MB"],
    context_lens: Int[Array, " S"],
    **kwargs,
) -> Float[Array, "S H D"]:
    """Decode: one query per sequence, at position context_len - 1 (context_len 0 = padding)."""
    cu = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    return ragged_paged_attention_reference(q, k_pool, v_pool, block_tables, cu, context_lens, max_q_len=1, **kwargs)
