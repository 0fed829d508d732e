"""Tiled flash attention in Pallas (Triton lowering): the forward here, the FlashAttention-2 backward
in flash_backward.py, shared pieces in flash_tiles.py.

Layout [B, T, H, D]. The query heads that share a K/V head are packed as extra rows of one tile
(row = token x head-in-group), so every K/V tile is loaded once for the whole group and dK/dV sum
over the group inside the kernel. Scores live only per (q tile, kv tile) in SRAM; the softmax is
online, in base 2, with the row log-sum-exp saved for the backward pass. The forward walks the K/V
tiles that need no mask in one loop and the (causal diagonal, padded) rest in another, and causal
launches the longest query tiles first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.flash_backward import flash_backward
from pallas_kernels.flash_tiles import (
    OFFSET_SPEC,
    BlockSizes,
    FlashStatic,
    block_specs,
    default_block_sizes,
    full_kv_end,
    group_tile,
    kv_range,
    load_tile,
    logits,
    masked_scores,
    prepare,
    read_offset,
    row_segments,
    row_tokens,
    store_tile,
    tile_rows,
)
from pallas_kernels.tile_ops import LOG2E, online_softmax_step

__all__ = ["BlockSizes", "flash_attention"]


def _forward_kernel(off_ref, q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, o_ref, lse_ref, *, st: FlashStatic):
    """One query tile over the K/V tiles it can see: the unmasked ones, then those needing a mask."""
    tile = pl.program_id(2)
    if st.causal:  # heavy first: the grid's slowest axis starts at the last (longest) query tile
        tile = pl.num_programs(2) - 1 - tile
    tok0 = tile * st.tokens
    offset = read_offset(off_ref, st)
    q = tile_rows(load_tile(q_ref, 0, st.tokens, st), st)
    q_tok = row_tokens(tok0, st)
    q_seg = row_segments(qseg_ref[...], st) if st.has_segments else None
    d = st.head_dim_pad

    def body(j, carry, masked: bool):
        acc, m, l = carry
        kv0 = j * st.block_k
        k = load_tile(k_ref, kv0, st.block_k, st)
        v = load_tile(v_ref, kv0, st.block_k, st)
        if masked:
            kv_seg = kvseg_ref[pl.ds(kv0, st.block_k)] if st.has_segments else None
            s, _ = masked_scores(q, k, q_tok, kv0, q_seg, kv_seg, offset, st)
        else:
            s = logits(q, k, st) * LOG2E
        return online_softmax_step(acc, m, l, s, v)

    lo, hi = kv_range(tok0, st.tokens, k_ref.shape[0] // st.block_k, offset, st)
    mid = full_kv_end(tok0, lo, hi, offset, st)
    init = (
        jnp.zeros((st.rows, d), jnp.float32),
        jnp.full((st.rows,), -jnp.inf, jnp.float32),
        jnp.zeros((st.rows,), jnp.float32),
    )
    carry = lax.fori_loop(lo, mid, functools.partial(body, masked=False), init)
    acc, m, l = lax.fori_loop(mid, hi, functools.partial(body, masked=True), carry)
    empty = l == 0.0  # rows that see no key (padding): output 0, lse +inf so backward p = 0
    out = acc / jnp.where(empty, 1.0, l)[:, None]
    store_tile(o_ref, 0, out.reshape(st.tokens, st.group, d), st)
    lse = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))
    lse_ref[...] = lse.reshape(st.tokens, st.group)


def _forward(q, k, v, q_seg, kv_seg, offset, st: FlashStatic, blocks: BlockSizes, interpret: bool):
    """Output [B, T, H, D] and the padded base-2 log-sum-exp [B, T', chunks, group]."""
    b, t, h, d = q.shape
    qp, kp, vp, q_seg, kv_seg, nc = prepare(q, k, v, q_seg, kv_seg, st, st.block_k)
    tq, tk = qp.shape[1], kp.shape[1]
    specs = block_specs(st, tq, tk, d, nc, q_tiled=True, kv_tiled=False, reverse=st.causal)
    q_spec, row_spec, kv_spec, qseg_spec, kvseg_spec = specs
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, st=st),
        grid=(b, qp.shape[2], tq // st.tokens),
        in_specs=[OFFSET_SPEC, q_spec, kv_spec, kv_spec, qseg_spec, kvseg_spec],
        out_specs=[q_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct(qp.shape, q.dtype), jax.ShapeDtypeStruct(qp.shape[:4], jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="jaxinfra_flash_fwd",
    )(offset, qp, kp, vp, q_seg, kv_seg)
    return out.reshape(b, tq, h, d)[:, :t], lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, q_seg, kv_seg, offset, st: FlashStatic, blocks: BlockSizes, interpret: bool):
    return _forward(q, k, v, q_seg, kv_seg, offset, st, blocks, interpret)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, offset, st, blocks, interpret):
    out, lse = _forward(q, k, v, q_seg, kv_seg, offset, st, blocks, interpret)
    return out, (q, k, v, q_seg, kv_seg, offset, out, lse)


def _flash_bwd(st, blocks, interpret, residuals, do):
    q, k, v, q_seg, kv_seg, offset, out, lse = residuals
    dq, dk, dv = flash_backward(q, k, v, q_seg, kv_seg, offset, out, lse, do, st, blocks, interpret)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S KH D"],
    v: Float[Array, "B S KH D"],
    *,
    causal: bool = True,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
) -> Float[Array, "B T H D"]:
    """Flash attention with the reference's semantics: query i sits at key position i + q_offset
    (default S - T: queries aligned to the end of the keys). `q_offset` may be traced (a device's
    chunk of a sequence split over devices); causal tiles past it are skipped either way.

    Differentiable in q, k, v. `interpret` defaults to True off GPU (the Pallas interpreter).
    """
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: expected [B,T,H,D], [B,S,KH,D] x2")
    if h % kh:
        raise ValueError(f"num query heads {h} must be a multiple of num kv heads {kh}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    traced_offset = q_offset is not None and not isinstance(q_offset, int)
    blocks = block_sizes or default_block_sizes(d, traced_offset)
    group = group_tile(h // kh)
    st = FlashStatic(
        causal=causal,
        window=sliding_window,
        softcap=logit_softcap,
        scale=d**-0.5 if scale is None else float(scale),
        has_segments=q_segment_ids is not None,
        q_len=t,
        kv_len=s,
        offset=s - t if q_offset is None else q_offset if isinstance(q_offset, int) else None,
        group=group,
        tokens=max(blocks.block_q // group, 1),
        block_k=blocks.block_k,
        head_dim=d,
    )
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    traced = q_offset if st.offset is None and q_offset is not None else 0
    offset = jnp.full((1,), traced, jnp.int32)
    return _flash(q, k, v, q_segment_ids, kv_segment_ids, offset, st, blocks, interpret)
