"""Plain jax.numpy multi-head attention: the oracle every attention kernel is checked against."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# A reference multiplies at full float32 precision: on a GPU the default runs float32 dots in TF32.
HIGHEST = jax.lax.Precision.HIGHEST


def attention_mask(
    q_positions: Int[Array, "B T"],
    kv_positions: Int[Array, "B S"],
    *,
    causal: bool,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Boolean [B, T, S]: which keys each query may see (causality, packing, local window)."""
    qp, kp = q_positions[:, :, None], kv_positions[:, None, :]
    mask = jnp.ones(jnp.broadcast_shapes(qp.shape, kp.shape), bool)
    if causal:
        mask &= kp <= qp
    if sliding_window is not None:
        mask &= qp - kp < sliding_window
    if q_segment_ids is not None and kv_segment_ids is not None:
        mask &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return mask


def mha_reference(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S KH D"],
    v: Float[Array, "B S KH D"],
    *,
    causal: bool = True,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    q_positions: Int[Array, "B T"] | None = None,
    kv_positions: Int[Array, "B S"] | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
) -> Float[Array, "B T H D"]:
    """Softmax(q k^T) v with GQA (query heads grouped over K/V heads, K/V never repeated).

    Without explicit positions, queries are aligned to the end of the keys (query i sits at key
    position S - T + i), which is plain causal self-attention when T == S. Queries that see no key
    (padding) return zeros instead of NaN. Accumulates in float32; returns q's dtype.
    """
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    if h % kh:
        raise ValueError(f"num query heads {h} must be a multiple of num kv heads {kh}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    scale = d**-0.5 if scale is None else scale
    if q_positions is None:
        q_positions = jnp.broadcast_to(jnp.arange(t) + (s - t), (b, t))
    if kv_positions is None:
        kv_positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    mask = attention_mask(
        q_positions,
        kv_positions,
        causal=causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        sliding_window=sliding_window,
    )
    qg = q.reshape(b, t, kh, h // kh, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32, precision=HIGHEST) * scale
    if logit_softcap is not None:
        logits = logit_softcap * jnp.tanh(logits / logit_softcap)
    mask = mask[:, None, None]
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    probs = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32), precision=HIGHEST)
    return out.reshape(b, t, h, d).astype(q.dtype)
