"""FlashAttention-2 backward of flash_attention.py in Pallas (Triton lowering): one kernel walks the
query tiles for each K/V tile (dK, dV; query heads of a group summed inside, chunks summed after),
one walks the K/V tiles for each query tile (dQ: like the forward, unmasked tiles in their own loop,
causal tiles longest first). Probabilities are recomputed from the saved base-2 log-sum-exp.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.flash_tiles import (
    OFFSET_SPEC,
    BlockSizes,
    FlashStatic,
    block_specs,
    full_kv_end,
    kv_range,
    load_tile,
    logits,
    masked_scores,
    pad_to,
    prepare,
    q_range,
    read_offset,
    row_segments,
    row_tokens,
    store_tile,
    tile_rows,
)
from pallas_kernels.tile_ops import LOG2E, dot


def _ds(q, k, v, do, lse, delta, q_tok, kv0, q_seg, kv_seg, offset, st: FlashStatic, masked: bool = True):
    """Probabilities and the gradient of the natural (pre-scale) logits for one tile pair (`masked`
    False: a pair full_kv_end says needs no mask)."""
    if masked:
        s, capped = masked_scores(q, k, q_tok, kv0, q_seg, kv_seg, offset, st)
    else:
        capped = logits(q, k, st)
        s = capped * LOG2E
    p = jnp.exp2(s - lse[:, None])
    dp = dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    if st.softcap is not None:
        ds = ds * (1.0 - (capped / st.softcap) ** 2)
    return p, ds * st.scale


def _dkdv_kernel(
    off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref, dk_ref, dv_ref, *, st: FlashStatic
):
    kv0 = pl.program_id(2) * st.block_k
    offset = read_offset(off_ref, st)
    k, v = load_tile(k_ref, 0, st.block_k, st), load_tile(v_ref, 0, st.block_k, st)
    kv_seg = kvseg_ref[...] if st.has_segments else None
    d = st.head_dim_pad

    def body(i, carry):
        dk, dv = carry
        tok0 = i * st.tokens
        sl = pl.ds(tok0, st.tokens)
        q = tile_rows(load_tile(q_ref, tok0, st.tokens, st), st)
        do = tile_rows(load_tile(do_ref, tok0, st.tokens, st), st)
        lse, delta = tile_rows(lse_ref[sl, :], st), tile_rows(delta_ref[sl, :], st)
        q_seg = row_segments(qseg_ref[sl], st) if st.has_segments else None
        p, ds = _ds(q, k, v, do, lse, delta, row_tokens(tok0, st), kv0, q_seg, kv_seg, offset, st)
        dv += dot(p.astype(do.dtype), do, trans_a=True)
        dk += dot(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv

    lo, hi = q_range(kv0, st.block_k, q_ref.shape[0] // st.tokens, offset, st)
    zeros = jnp.zeros((st.block_k, d), jnp.float32)
    dk, dv = lax.fori_loop(lo, hi, body, (zeros, zeros))
    store_tile(dk_ref, 0, dk, st)
    store_tile(dv_ref, 0, dv, st)


def _dq_kernel(
    off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref, dq_ref, *, st: FlashStatic
):
    """dQ of one query tile: the unmasked K/V tiles, then the masked ones; causal: longest tiles first."""
    tile = pl.program_id(2)
    if st.causal:
        tile = pl.num_programs(2) - 1 - tile
    tok0 = tile * st.tokens
    offset = read_offset(off_ref, st)
    q, do = (tile_rows(load_tile(ref, 0, st.tokens, st), st) for ref in (q_ref, do_ref))
    lse, delta = tile_rows(lse_ref[...], st), tile_rows(delta_ref[...], st)
    q_tok = row_tokens(tok0, st)
    q_seg = row_segments(qseg_ref[...], st) if st.has_segments else None

    def body(j, dq, masked: bool):
        kv0 = j * st.block_k
        k = load_tile(k_ref, kv0, st.block_k, st)
        v = load_tile(v_ref, kv0, st.block_k, st)
        kv_seg = kvseg_ref[pl.ds(kv0, st.block_k)] if st.has_segments and masked else None
        _, ds = _ds(q, k, v, do, lse, delta, q_tok, kv0, q_seg, kv_seg, offset, st, masked)
        return dq + dot(ds.astype(k.dtype), k)

    lo, hi = kv_range(tok0, st.tokens, k_ref.shape[0] // st.block_k, offset, st)
    mid = full_kv_end(tok0, lo, hi, offset, st)
    dq = lax.fori_loop(lo, mid, functools.partial(body, masked=False), jnp.zeros((st.rows, q.shape[-1]), jnp.float32))
    dq = lax.fori_loop(mid, hi, functools.partial(body, masked=True), dq)
    store_tile(dq_ref, 0, dq.reshape(st.tokens, st.group, -1), st)


def flash_backward(q, k, v, q_seg, kv_seg, offset, out, lse, do, st: FlashStatic, blocks: BlockSizes, interpret: bool):
    """dq, dk, dv of flash attention given its output and base-2 log-sum-exp (as the forward saved it)."""
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    bst = dataclasses.replace(st, tokens=max(blocks.block_q_bwd // st.group, 1), block_k=blocks.block_k_bwd)
    qp, kp, vp, q_seg, kv_seg, nc = prepare(q, k, v, q_seg, kv_seg, bst, bst.block_k)
    tq, tk = qp.shape[1], kp.shape[1]
    dop = pad_to(do, 1, bst.tokens).reshape(qp.shape)
    delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    delta = pad_to(delta, 1, bst.tokens).reshape(qp.shape[:4])
    lse_full = lse.reshape(b, -1, h)[:, :t]
    lse_p = pad_to(lse_full, 1, bst.tokens, value=jnp.inf).reshape(qp.shape[:4])
    params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    chunks = qp.shape[2]

    q_full, row_full, kv_tile, qseg_full, kvseg_tile = block_specs(bst, tq, tk, d, nc, q_tiled=False, kv_tiled=True)
    part_spec = pl.BlockSpec((pl.squeezed, bst.block_k, pl.squeezed, d), lambda bi, hi, i: (bi, i, hi, 0))
    dk_part, dv_part = pl.pallas_call(
        functools.partial(_dkdv_kernel, st=bst),
        grid=(b, chunks, tk // bst.block_k),
        in_specs=[OFFSET_SPEC, q_full, kv_tile, kv_tile, q_full, row_full, row_full, qseg_full, kvseg_tile],
        out_specs=[part_spec, part_spec],
        out_shape=[jax.ShapeDtypeStruct((b, tk, chunks, d), jnp.float32)] * 2,
        compiler_params=params,
        interpret=interpret,
        name="jaxinfra_flash_dkdv",
    )(offset, qp, kp, vp, dop, lse_p, delta, q_seg, kv_seg)
    dk = dk_part.reshape(b, tk, kh, nc, d).sum(3)[:, :s].astype(k.dtype)
    dv = dv_part.reshape(b, tk, kh, nc, d).sum(3)[:, :s].astype(v.dtype)

    specs = block_specs(bst, tq, tk, d, nc, q_tiled=True, kv_tiled=False, reverse=bst.causal)
    q_tile, row_tile, kv_full, qseg_tile, kvseg_full = specs
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, st=bst),
        grid=(b, chunks, tq // bst.tokens),
        in_specs=[OFFSET_SPEC, q_tile, kv_full, kv_full, q_tile, row_tile, row_tile, qseg_tile, kvseg_full],
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="jaxinfra_flash_dq",
    )(offset, qp, kp, vp, dop, lse_p, delta, q_seg, kv_seg)
    return dq.reshape(b, tq, h, d)[:, :t], dk, dv
