"""Tiled flash attention in Pallas (Triton lowering): forward and FlashAttention-2 backward.

Layout [B, T, H, D]. The query heads that share a K/V head are packed as extra rows of one tile
(row = token x head-in-group), so every K/V tile is loaded once for the whole group and dK/dV sum
over the group inside the kernel. Scores live only per (q tile, kv tile) in SRAM; the softmax is
online, in base 2, with the row log-sum-exp saved for the backward pass.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.tile_ops import dot, online_softmax_step

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes. block_q counts query rows (tokens x grouped heads); block_k counts keys."""

    block_q: int = 128
    block_k: int = 64
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {value}")


# Per head dim: bigger heads need smaller tiles to stay in SRAM/registers.
DEFAULT_BLOCK_SIZES = {
    64: BlockSizes(block_q=128, block_k=64, block_q_bwd=64, block_k_bwd=64, num_warps=4, num_stages=3),
    128: BlockSizes(block_q=128, block_k=64, block_q_bwd=64, block_k_bwd=64, num_warps=8, num_stages=2),
    256: BlockSizes(block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=32, num_warps=8, num_stages=2),
}


def default_block_sizes(head_dim: int) -> BlockSizes:
    for d in sorted(DEFAULT_BLOCK_SIZES):
        if head_dim <= d:
            return DEFAULT_BLOCK_SIZES[d]
    return DEFAULT_BLOCK_SIZES[max(DEFAULT_BLOCK_SIZES)]


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernels need to know at trace time."""

    causal: bool
    window: int | None
    softcap: float | None
    scale: float
    has_segments: bool
    q_len: int  # true (unpadded) lengths
    kv_len: int
    offset: int | None  # query i sits at key position i + offset; None: read at run time (traced)
    group: int  # query heads per tile (power of two dividing the GQA ratio)
    tokens: int  # query tokens per tile
    block_k: int

    @property
    def rows(self) -> int:
        return self.tokens * self.group


def _row_tokens(tok0: jax.Array, st: _Static) -> jax.Array:
    return tok0 + lax.broadcasted_iota(jnp.int32, (st.rows,), 0) // st.group


def _rows(x: jax.Array, st: _Static) -> jax.Array:
    """[tokens, group, ...] tile -> [rows, ...]."""
    return x.reshape(st.rows, *x.shape[2:])


def _row_segments(seg: jax.Array, st: _Static) -> jax.Array:
    return jnp.broadcast_to(seg[:, None], (st.tokens, st.group)).reshape(st.rows)


def _scores(
    q: jax.Array,
    k: jax.Array,
    q_tok: jax.Array,
    kv0: jax.Array,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    offset: jax.Array,
    st: _Static,
) -> tuple[jax.Array, jax.Array]:
    """Masked base-2 logits [rows, block_k] and the capped natural logits (for the softcap grad)."""
    s = dot(q, k, trans_b=True) * st.scale
    if st.softcap is not None:
        s = st.softcap * jnp.tanh(s / st.softcap)
    kv_idx = kv0 + lax.broadcasted_iota(jnp.int32, (st.block_k,), 0)
    q_pos = (q_tok + offset)[:, None]
    mask = (kv_idx < st.kv_len)[None, :] & (q_tok < st.q_len)[:, None]
    if st.causal:
        mask &= kv_idx[None, :] <= q_pos
    if st.window is not None:
        mask &= q_pos - kv_idx[None, :] < st.window
    if st.has_segments and q_seg is not None and kv_seg is not None:
        mask &= q_seg[:, None] == kv_seg[None, :]
    return jnp.where(mask, s * LOG2E, -jnp.inf), s


def _kv_range(
    tok0: jax.Array, tokens: int, num_kv_blocks: int, offset: jax.Array, st: _Static
) -> tuple[jax.Array, jax.Array]:
    """The kv tiles a query tile can see (causal and window skip the others)."""
    lo, hi = jnp.int32(0), jnp.int32(num_kv_blocks)
    if st.causal:
        last = tok0 + tokens + offset  # one past the last visible key
        hi = jnp.clip(lax.div(jnp.maximum(last, 0) + st.block_k - 1, st.block_k), 0, num_kv_blocks)
    if st.window is not None:
        first = jnp.maximum(tok0 + offset - st.window + 1, 0)
        lo = jnp.minimum(lax.div(first, st.block_k), hi)
    return lo, hi


def _q_range(
    kv0: jax.Array, block_k: int, num_q_blocks: int, offset: jax.Array, st: _Static
) -> tuple[jax.Array, jax.Array]:
    """The query tiles that can see a kv tile."""
    lo, hi = jnp.int32(0), jnp.int32(num_q_blocks)
    if st.causal:
        first = jnp.maximum(kv0 - offset, 0)
        lo = jnp.minimum(lax.div(first, st.tokens), num_q_blocks)
    if st.window is not None:
        last = kv0 + block_k - 1 + st.window - 1 - offset  # last query that still sees this tile
        hi = jnp.clip(lax.div(jnp.maximum(last, -1) + 1 + st.tokens - 1, st.tokens), lo, num_q_blocks)
    return lo, hi


def _forward_kernel(off_ref, q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, o_ref, lse_ref, *, st: _Static):
    tok0 = pl.program_id(2) * st.tokens
    offset = _offset(off_ref, st)
    q = _rows(q_ref[...], st)
    q_tok = _row_tokens(tok0, st)
    q_seg = _row_segments(qseg_ref[...], st) if st.has_segments else None
    d = q.shape[-1]

    def body(j, carry):
        acc, m, l = carry
        kv0 = j * st.block_k
        k = k_ref[pl.ds(kv0, st.block_k), :]
        v = v_ref[pl.ds(kv0, st.block_k), :]
        kv_seg = kvseg_ref[pl.ds(kv0, st.block_k)] if st.has_segments else None
        s, _ = _scores(q, k, q_tok, kv0, q_seg, kv_seg, offset, st)
        return online_softmax_step(acc, m, l, s, v)

    lo, hi = _kv_range(tok0, st.tokens, k_ref.shape[0] // st.block_k, offset, st)
    init = (
        jnp.zeros((st.rows, d), jnp.float32),
        jnp.full((st.rows,), -jnp.inf, jnp.float32),
        jnp.zeros((st.rows,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(lo, hi, body, init)
    empty = l == 0.0  # rows that see no key (padding): output 0, lse +inf so backward p = 0
    out = acc / jnp.where(empty, 1.0, l)[:, None]
    o_ref[...] = out.reshape(st.tokens, st.group, d).astype(o_ref.dtype)
    lse = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))
    lse_ref[...] = lse.reshape(st.tokens, st.group)


def _ds(q, k, v, do, lse, delta, q_tok, kv0, q_seg, kv_seg, offset, st: _Static):
    """Probabilities and the gradient of the natural (pre-scale) logits for one tile pair."""
    s, capped = _scores(q, k, q_tok, kv0, q_seg, kv_seg, offset, st)
    p = jnp.exp2(s - lse[:, None])
    dp = dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    if st.softcap is not None:
        ds = ds * (1.0 - (capped / st.softcap) ** 2)
    return p, ds * st.scale


def _dkdv_kernel(
    off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref, dk_ref, dv_ref, *, st: _Static
):
    kv0 = pl.program_id(2) * st.block_k
    offset = _offset(off_ref, st)
    k, v = k_ref[...], v_ref[...]
    kv_seg = kvseg_ref[...] if st.has_segments else None
    d = k.shape[-1]

    def body(i, carry):
        dk, dv = carry
        tok0 = i * st.tokens
        sl = pl.ds(tok0, st.tokens)
        q = _rows(q_ref[sl, :, :], st)
        do = _rows(do_ref[sl, :, :], st)
        lse, delta = _rows(lse_ref[sl, :], st), _rows(delta_ref[sl, :], st)
        q_seg = _row_segments(qseg_ref[sl], st) if st.has_segments else None
        p, ds = _ds(q, k, v, do, lse, delta, _row_tokens(tok0, st), kv0, q_seg, kv_seg, offset, st)
        dv += dot(p.astype(do.dtype), do, trans_a=True)
        dk += dot(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv

    lo, hi = _q_range(kv0, st.block_k, q_ref.shape[0] // st.tokens, offset, st)
    zeros = jnp.zeros((st.block_k, d), jnp.float32)
    dk, dv = lax.fori_loop(lo, hi, body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref, dq_ref, *, st: _Static):
    tok0 = pl.program_id(2) * st.tokens
    offset = _offset(off_ref, st)
    q, do = _rows(q_ref[...], st), _rows(do_ref[...], st)
    lse, delta = _rows(lse_ref[...], st), _rows(delta_ref[...], st)
    q_tok = _row_tokens(tok0, st)
    q_seg = _row_segments(qseg_ref[...], st) if st.has_segments else None

    def body(j, dq):
        kv0 = j * st.block_k
        k = k_ref[pl.ds(kv0, st.block_k), :]
        v = v_ref[pl.ds(kv0, st.block_k), :]
        kv_seg = kvseg_ref[pl.ds(kv0, st.block_k)] if st.has_segments else None
        _, ds = _ds(q, k, v, do, lse, delta, q_tok, kv0, q_seg, kv_seg, offset, st)
        return dq + dot(ds.astype(k.dtype), k)

    lo, hi = _kv_range(tok0, st.tokens, k_ref.shape[0] // st.block_k, offset, st)
    dq = lax.fori_loop(lo, hi, body, jnp.zeros((st.rows, q.shape[-1]), jnp.float32))
    dq_ref[...] = dq.reshape(st.tokens, st.group, -1).astype(dq_ref.dtype)


# ---------------------------------------------------------------------------------------------
# Wrappers: padding, grouping, pallas_call specs.
# ---------------------------------------------------------------------------------------------
def _group_tile(group: int) -> int:
    """Largest power of two dividing the GQA ratio: heads packed into one tile."""
    return group & -group


def _pad_to(x: jax.Array, axis: int, multiple: int, value: int | float = 0) -> jax.Array:
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _specs(st: _Static, tq: int, tk: int, d: int, nc: int, *, q_tiled: bool, kv_tiled: bool):
    """BlockSpecs over grid (batch, head-chunk, tile). q/k tiles or whole sequences per program."""
    sq = pl.squeezed

    def q_map(b, h, i):
        return (b, i if q_tiled else 0, h, 0, 0)

    def kv_map(b, h, i):
        return (b, i if kv_tiled else 0, h // nc, 0)

    q_len = st.tokens if q_tiled else tq
    kv_len = st.block_k if kv_tiled else tk
    q_spec = pl.BlockSpec((sq, q_len, sq, st.group, d), q_map)
    row_spec = pl.BlockSpec((sq, q_len, sq, st.group), lambda b, h, i: q_map(b, h, i)[:4])
    kv_spec = pl.BlockSpec((sq, kv_len, sq, d), kv_map)
    qseg_spec = pl.BlockSpec((sq, q_len), lambda b, h, i: (b, i if q_tiled else 0))
    kvseg_spec = pl.BlockSpec((sq, kv_len), lambda b, h, i: (b, i if kv_tiled else 0))
    return q_spec, row_spec, kv_spec, qseg_spec, kvseg_spec


_OFFSET_SPEC = pl.BlockSpec((1,), lambda *_: (0,))  # a traced query offset, one int32 read by every program


def _offset(off_ref, st: _Static):
    """The query offset: a compile-time constant unless it was traced."""
    return off_ref[0] if st.offset is None else st.offset


def _prepare(q, k, v, q_seg, kv_seg, st: _Static, block_k: int):
    """Pad lengths to tile multiples and view q as [B, T, head-chunks, group, D]."""
    b, t, h, d = q.shape
    kh = k.shape[2]
    nc = h // st.group
    qp = _pad_to(q, 1, st.tokens).reshape(b, -1, nc, st.group, d)
    kp, vp = _pad_to(k, 1, block_k), _pad_to(v, 1, block_k)
    if q_seg is None:
        q_seg, kv_seg = jnp.zeros((b, t), jnp.int32), jnp.zeros((b, k.shape[1]), jnp.int32)
    q_seg = _pad_to(q_seg.astype(jnp.int32), 1, st.tokens)
    kv_seg = _pad_to(kv_seg.astype(jnp.int32), 1, block_k)
    return qp, kp, vp, q_seg, kv_seg, nc // kh


def _forward(q, k, v, q_seg, kv_seg, offset, st: _Static, blocks: BlockSizes, interpret: bool):
    b, t, h, d = q.shape
    qp, kp, vp, q_seg, kv_seg, nc = _prepare(q, k, v, q_seg, kv_seg, st, st.block_k)
    tq, tk = qp.shape[1], kp.shape[1]
    q_spec, row_spec, kv_spec, qseg_spec, kvseg_spec = _specs(st, tq, tk, d, nc, q_tiled=True, kv_tiled=False)
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, st=st),
        grid=(b, qp.shape[2], tq // st.tokens),
        in_specs=[_OFFSET_SPEC, q_spec, kv_spec, kv_spec, qseg_spec, kvseg_spec],
        out_specs=[q_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct(qp.shape, q.dtype), jax.ShapeDtypeStruct(qp.shape[:4], jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="jaxinfra_flash_fwd",
    )(offset, qp, kp, vp, q_seg, kv_seg)
    return out.reshape(b, tq, h, d)[:, :t], lse


def _backward(q, k, v, q_seg, kv_seg, offset, out, lse, do, st: _Static, blocks: BlockSizes, interpret: bool):
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    bst = dataclasses.replace(st, tokens=max(blocks.block_q_bwd // st.group, 1), block_k=blocks.block_k_bwd)
    qp, kp, vp, q_seg, kv_seg, nc = _prepare(q, k, v, q_seg, kv_seg, bst, bst.block_k)
    tq, tk = qp.shape[1], kp.shape[1]
    dop = _pad_to(do, 1, bst.tokens).reshape(qp.shape)
    delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    delta = _pad_to(delta, 1, bst.tokens).reshape(qp.shape[:4])
    lse_full = lse.reshape(b, -1, h)[:, :t]
    lse_p = _pad_to(lse_full, 1, bst.tokens, value=jnp.inf).reshape(qp.shape[:4])
    params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    chunks = qp.shape[2]

    q_full, row_full, kv_tile, qseg_full, kvseg_tile = _specs(bst, tq, tk, d, nc, q_tiled=False, kv_tiled=True)
    part_spec = pl.BlockSpec((pl.squeezed, bst.block_k, pl.squeezed, d), lambda bi, hi, i: (bi, i, hi, 0))
    dk_part, dv_part = pl.pallas_call(
        functools.partial(_dkdv_kernel, st=bst),
        grid=(b, chunks, tk // bst.block_k),
        in_specs=[_OFFSET_SPEC, q_full, kv_tile, kv_tile, q_full, row_full, row_full, qseg_full, kvseg_tile],
        out_specs=[part_spec, part_spec],
        out_shape=[jax.ShapeDtypeStruct((b, tk, chunks, d), jnp.float32)] * 2,
        compiler_params=params,
        interpret=interpret,
        name="jaxinfra_flash_dkdv",
    )(offset, qp, kp, vp, dop, lse_p, delta, q_seg, kv_seg)
    dk = dk_part.reshape(b, tk, kh, nc, d).sum(3)[:, :s].astype(k.dtype)
    dv = dv_part.reshape(b, tk, kh, nc, d).sum(3)[:, :s].astype(v.dtype)

    q_tile, row_tile, kv_full, qseg_tile, kvseg_full = _specs(bst, tq, tk, d, nc, q_tiled=True, kv_tiled=False)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, st=bst),
        grid=(b, chunks, tq // bst.tokens),
        in_specs=[_OFFSET_SPEC, q_tile, kv_full, kv_full, q_tile, row_tile, row_tile, qseg_tile, kvseg_full],
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="jaxinfra_flash_dq",
    )(offset, qp, kp, vp, dop, lse_p, delta, q_seg, kv_seg)
    return dq.reshape(b, tq, h, d)[:, :t], dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, q_seg, kv_seg, offset, st: _Static, blocks: BlockSizes, interpret: bool):
    return _forward(q, k, v, q_seg, kv_seg, offset, st, blocks, interpret)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, offset, st, blocks, interpret):
    out, lse = _forward(q, k, v, q_seg, kv_seg, offset, st, blocks, interpret)
    return out, (q, k, v, q_seg, kv_seg, offset, out, lse)


def _flash_bwd(st, blocks, interpret, residuals, do):
    q, k, v, q_seg, kv_seg, offset, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, q_seg, kv_seg, offset, out, lse, do, st, blocks, interpret)
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
    blocks = block_sizes or default_block_sizes(d)
    group = _group_tile(h // kh)
    st = _Static(
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
    )
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    dp = max(16, pl.next_power_of_2(d))  # Triton tiles need power-of-two sizes; zero columns are inert
    if dp != d:
        q, k, v = (jnp.pad(x, [(0, 0)] * 3 + [(0, dp - d)]) for x in (q, k, v))
    traced = q_offset if st.offset is None and q_offset is not None else 0
    offset = jnp.full((1,), traced, jnp.int32)
    return _flash(q, k, v, q_segment_ids, kv_segment_ids, offset, st, blocks, interpret)[..., :d]
