"""Ragged paged attention written for XLA: the CPU serving path, and a baseline on GPU.

Work tiles as in the Pallas kernel (`tokens` new tokens of one sequence each). A loop walks the
pages `pages_per_step` at a time with an online softmax, up to the longest context in the batch
(a run-time bound: block-table padding costs nothing). Each step gathers a few pages per tile,
small enough to stay in cache, and reduces over head_dim in one fusion. The tile plan (which rows,
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
# Keys gathered per loop step across all tiles: enough to amortise a step's fixed cost, few enough
# to stay in cache (measured on 2 CPU cores: 64 tiles x 2 pages of 16 tokens was best).
KEYS_PER_STEP = 2048


def tile_tokens(max_q_len: int | None, n: int) -> int:
    """Tokens per tile for a batch of n tokens whose sequences bring at most max_q_len each."""
    return 1 if (max_q_len or n) == 1 else min(MIXED_TILE_TOKENS, max_q_len or n)


def _gather_pages(pool: jax.Array, scales: jax.Array | None, pages: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """pool [NB, BS, KH, D], pages [T, P] -> [T, P * BS, KH, D] in `dtype` (int8 dequantised)."""
    t, p = pages.shape
    _, bs, kh, d = pool.shape
    x = jnp.take(pool, pages, axis=0, mode="clip")
    if scales is not None:
        x = x.astype(jnp.float32) * jnp.take(scales, pages, axis=0, mode="clip")[..., None]
    return x.astype(dtype).reshape(t, p * bs, kh, d)


def ragged_paged_attention_xla(
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
    plan: TilePlan | None = None,
    pages_per_step: int | None = None,
) -> Float[Array, "N H D"]:
    """Same contract as `ragged_paged_attention_reference`; `plan` (from `tile_plan`) may be given."""
    n, h, d = q.shape
    _, bs, kh, _ = k_pool.shape
    if h % kh:
        raise ValueError(f"num query heads {h} must be a multiple of num kv heads {kh}")
    g = h // kh
    if plan is None:
        plan = tile_plan(
            cu_q_lens.astype(jnp.int32),
            kv_lens.astype(jnp.int32),
            block_tables.astype(jnp.int32),
            bs,
            n,
            tile_tokens(max_q_len, n),
        )
    num_tiles, tokens = plan.q_index.shape
    # A tile's rows are (token, query head of a KV group). Size-1 axes make XLA's CPU reductions slow,
    # so a tile of one row (decode without GQA) has no row axis at all.
    rows = (tokens * g,) if tokens * g > 1 else ()
    scale = d**-0.5 if scale is None else scale
    qt = jnp.take(q, plan.q_index, axis=0, mode="clip").astype(jnp.float32) * scale
    qt = qt.reshape(num_tiles, tokens, kh, g, d).transpose(0, 1, 3, 2, 4).reshape(num_tiles, 1, *rows, kh, d)
    q_pos = jnp.repeat(plan.q_pos, g, axis=1).reshape(num_tiles, *rows)  # [T, (rows)]
    if pages_per_step is None:  # below the table width: a loop of one step gets the pools copied (XLA CPU)
        pages_per_step = max(1, min(KEYS_PER_STEP // (num_tiles * bs), plan.pages.shape[1] // 2))
    per_step = pages_per_step * bs
    pages = jnp.pad(plan.pages, ((0, 0), (0, -plan.pages.shape[1] % pages_per_step)), mode="edge")
    hi = (jnp.max(q_pos) + per_step) // per_step  # steps up to the longest context in the batch
    lo = jnp.int32(0)
    if sliding_window is not None:
        first = jnp.min(jnp.where(q_pos >= 0, q_pos, jnp.iinfo(jnp.int32).max)) - sliding_window + 1
        lo = jnp.clip(first // per_step, 0, hi)

    def kv(pool: jax.Array, scales: jax.Array | None, pg: jax.Array) -> jax.Array:
        x = _gather_pages(pool, scales, pg, jnp.float32)  # [T, L, KH, D]
        return x[:, :, None] if rows else x

    def step(j, carry):
        m, l, acc = carry
        pg = jax.lax.dynamic_slice_in_dim(pages, j * pages_per_step, pages_per_step, axis=1)
        s = jnp.sum(qt * kv(k_pool, k_scales, pg), axis=-1)  # [T, L, (rows), KH]
        if logit_softcap is not None:
            s = logit_softcap * jnp.tanh(s / logit_softcap)
        kv_pos = (j * per_step + jnp.arange(per_step)).reshape(1, per_step, *(1,) * len(rows))
        visible = kv_pos <= q_pos[:, None]
        if sliding_window is not None:
            visible &= q_pos[:, None] - kv_pos < sliding_window
        s = jnp.where(visible[..., None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))  # [T, (rows), KH]
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, None])
        corr = jnp.exp(m - m_safe)
        acc = acc * corr[..., None] + jnp.sum(p[..., None] * kv(v_pool, v_scales, pg), axis=1)
        return m_new, l * corr + jnp.sum(p, axis=1), acc

    shape = (num_tiles, *rows, kh)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(lo, hi, step, init)
    out = (acc / jnp.where(l == 0, 1.0, l)[..., None]).reshape(num_tiles, tokens, g, kh, d)
    out = out.transpose(0, 1, 3, 2, 4).reshape(num_tiles * tokens, h, d)
    flat = jnp.take(out, plan.out_index, axis=0, mode="clip")
    return jnp.where(plan.out_index[:, None, None] >= 0, flat, 0).astype(q.dtype)
