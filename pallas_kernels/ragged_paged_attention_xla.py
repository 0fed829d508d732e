"""Ragged paged attention written for XLA: the CPU serving path, and a baseline on GPU.

Work tiles as in the Pallas kernel (`tokens` new tokens of one sequence each). A tile's pages are
gathered straight into [tile, kv_head, key, head_dim] (the transpose fuses into the gather), so both
matmuls have their batch dimensions leading and XLA inserts no copies. The tile plan (which rows,
which pages) is best built on the host once per step: computed in the jitted graph, its index
arithmetic is fused into the page gathers and repeated for every gathered element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.paged_tiles import TilePlan, tile_plan

# New tokens per tile when a batch holds prompt chunks: larger tiles gather each sequence's pages
# fewer times, smaller ones waste fewer rows on the batch's decodes (one token each).
MIXED_TILE_TOKENS = 4


def tile_tokens(max_q_len: int | None, n: int) -> int:
    """Tokens per tile for a batch of n tokens whose sequences bring at most max_q_len each."""
    return 1 if (max_q_len or n) == 1 else min(MIXED_TILE_TOKENS, max_q_len or n)


def _gather_pages(pool: jax.Array, scales: jax.Array | None, pages: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """pool [NB, BS, KH, D], pages [T, MB] -> [T, KH, MB * BS, D] in `dtype` (int8 dequantised)."""
    t, mb = pages.shape
    _, bs, kh, d = pool.shape
    x = jnp.take(pool, pages, axis=0, mode="clip")
    if scales is not None:
        x = x.astype(jnp.float32) * jnp.take(scales, pages, axis=0, mode="clip")[..., None]
    return x.astype(dtype).transpose(0, 3, 1, 2, 4).reshape(t, kh, mb * bs, d)


def ragged_paged_attention_xla(
    q: Float[Array, "N H D"],
    k_pool: Float[Array, "NB BS KH D"],
    v_pool: Float[Array, "NB BS KH D"],
    block_tables: Int[Array, "S MB"],
    cu_q_lens: Int[Array, "S1"],
    kv_lens: Int[Array, "S"],
    *,
    k_scales: Float[Array, "NB BS KH"] | None = None,
    v_scales: Float[Array, "NB BS KH"] | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    max_q_len: int | None = None,
    plan: TilePlan | None = None,
) -> Float[Array, "N H D"]:
    """Same contract as `ragged_paged_attention_reference`; `plan` (from `tile_plan`) may be given."""
    n, h, d = q.shape
    _, bs, kh, _ = k_pool.shape
    if h % kh:
        raise ValueError(f"num query heads {h} must be a multiple of num kv heads {kh}")
    g = h // kh
    if plan is None:
        plan = tile_plan(cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32), block_tables.astype(jnp.int32),
                         bs, n, tile_tokens(max_q_len, n))
    num_tiles, tokens = plan.q_index.shape
    qt = jnp.take(q, plan.q_index, axis=0, mode="clip")                    # [T, tokens, H, D]
    qt = qt.reshape(num_tiles, tokens, kh, g, d).transpose(0, 2, 1, 3, 4).reshape(num_tiles, kh, tokens * g, d)
    k = _gather_pages(k_pool, k_scales, plan.pages, q.dtype)
    v = _gather_pages(v_pool, v_scales, plan.pages, q.dtype)

    scale = d**-0.5 if scale is None else scale
    logits = jnp.einsum("tkrd,tkld->tkrl", qt, k, preferred_element_type=jnp.float32) * scale
    if logit_softcap is not None:
        logits = logit_softcap * jnp.tanh(logits / logit_softcap)
    q_pos = jnp.repeat(plan.q_pos, g, axis=1)[:, None, :, None]             # [T, 1, tokens * G, 1]
    kv_pos = jnp.arange(k.shape[2])
    mask = kv_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - kv_pos < sliding_window
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    probs = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("tkrl,tkld->tkrd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.reshape(num_tiles, kh, tokens, g, d).transpose(0, 2, 1, 3, 4).reshape(num_tiles * tokens, h, d)
    flat = jnp.take(out, plan.out_index, axis=0, mode="clip")
    return jnp.where(plan.out_index[:, None, None] >= 0, flat, 0).astype(q.dtype)
