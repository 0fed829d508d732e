"""Ragged paged attention in Pallas (Triton lowering): one kernel for decode, prefill chunks and mixes.

The flat token batch is cut into work tiles of `tokens` new tokens of one sequence (decode: one tile
per token); a tile's rows are (token x query head of one KV group), so each K/V page is loaded once
for the whole group. The kernel gathers its query rows from, and scatters its outputs to, the flat
[N * H, D] arrays itself (rows padded to the MMA's 16 in registers only). Pages are found through the
block table, several per step. Any head dim is read at its true width (80, 96: masked loads, padded
to a power of two in registers only), so pools hold no padding columns. Split-K cuts a long context
into `num_splits` page ranges whose float32 partials a small merge kernel combines (one split: the
output is written in the query dtype directly). Only pages the sequence owns are ever read. K/V may
be int8 or fp8 with per-token, per-head scales: the kernel converts the loaded integers (exactly) to
the query dtype and applies the scales to each key's logits and each value's probabilities, not to
every loaded element.
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

from pallas_kernels.kv_quant import is_quantized_kv
from pallas_kernels.paged_tiles import kernel_work_list, max_work_tiles
from pallas_kernels.split_merge import merge_splits
from pallas_kernels.tile_ops import LOG2E, dot, head_cols, online_softmax_step, register_head_dim

# Rows x head_dim one program holds in registers (q, the f32 accumulator): past this ptxas spills on
# sm_90a at 4 warps (benchmarks/kernel_report.py: 708 B at 128 rows x 128), so tiles get 8 warps from
# 64 x 128 on and never more rows than this.
MAX_TILE_ELEMENTS = 128 * 128
# Triton addresses an array with 32-bit offsets when it holds <= 2^32 bytes, and sign-extends them:
# a pool of 1-byte elements with more than 2^31 of them would be read at negative offsets
# (64-bit offsets appear in the IR only past 2^32 bytes; tests/kernels checks both sides).
MAX_I32_ELEMENTS = 2**31 - 1
BLOCK_Q = 16  # new tokens per work tile, at most
KEYS_PER_STEP = 64  # keys (pages x page size) loaded per inner step
# Triton's pipeliner gathers the next step's K pages into shared memory (cp.async) and its V pages
# into registers while this step computes; a deeper num_stages adds no buffer for these indirect
# loads (the sm_90a TTGIR is the same at 3 and 4), so two stages it is.
NUM_STAGES = 2


@dataclasses.dataclass(frozen=True)
class _Static:
    tokens: int  # new tokens per work tile
    group: int  # query heads per KV head (real)
    group_pad: int  # rows per token in a tile: the group padded to a power of two, >= 16 // tokens
    num_heads: int
    page_size: int
    pages_per_tile: int  # pages loaded per inner step
    pages_per_split: int
    window: int | None
    softcap: float | None
    scale: float
    quantized: bool
    head_dim: int  # true width of q, the pools and the output

    @property
    def head_dim_pad(self) -> int:
        return register_head_dim(self.head_dim)

    @property
    def rows(self) -> int:
        return self.tokens * self.group_pad

    @property
    def block_k(self) -> int:
        return self.pages_per_tile * self.page_size


def _load_pages(pool_ref, ids: jax.Array, st: _Static, dtype: jnp.dtype) -> jax.Array:
    """[block_k, D'] keys or values of pages `ids`, int8/fp8 converted exactly (scales applied later);
    columns past the true head dim read as zeros, which change no dot product."""
    if st.head_dim == st.head_dim_pad:
        return pool_ref[ids].reshape(st.block_k, -1).astype(dtype)
    cols, col_valid = head_cols(st.head_dim)
    slots = lax.broadcasted_iota(jnp.int32, (st.page_size,), 0)
    pages = plgpu.load(
        pool_ref.at[ids[:, None, None], slots[None, :, None], cols[None, None, :]],
        mask=col_valid[None, None, :],
        other=0,
    )
    return pages.reshape(st.block_k, st.head_dim_pad).astype(dtype)


def _kernel(work_ref, cu_ref, kvl_ref, bt_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, *out_refs, st: _Static):
    """One work tile (up to `tokens` new tokens of one sequence) x one KV head x one KV split. Rows are
    (token, query head of the group), gathered from and scattered to the flat [N * H, D] arrays."""
    t, g, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_seqs, max_pages = kvl_ref.shape[0], bt_ref.shape[1]
    total_rows = q_ref.shape[0]
    d = st.head_dim_pad
    seq, q_start = work_ref[t, 0], work_ref[t, 1]
    padding = seq >= num_seqs  # the batch's padding tokens: no keys, zero output
    s_idx = jnp.minimum(seq, num_seqs - 1)
    first_row = jnp.where(padding, cu_ref[num_seqs], cu_ref[s_idx])
    q_len = jnp.where(padding, total_rows // st.num_heads - cu_ref[num_seqs], cu_ref[s_idx + 1] - cu_ref[s_idx])
    # A length past what the block table can address is cut there: no page beyond the table is read.
    kv_len = jnp.where(padding, 0, jnp.minimum(kvl_ref[s_idx], max_pages * st.page_size))
    r = lax.broadcasted_iota(jnp.int32, (st.rows,), 0)
    tok, head = q_start + r // st.group_pad, r % st.group_pad
    row_valid = (tok < q_len) & (head < st.group)
    # Rows that are not real (token, head) pairs point past the array: masked, they touch nothing.
    flat = jnp.where(row_valid, (first_row + tok) * st.num_heads + g * st.group + head, total_rows)
    cols, col_valid = head_cols(st.head_dim)
    tile_mask = row_valid[:, None] & col_valid[None, :]
    q = plgpu.load(q_ref.at[flat[:, None], cols[None, :]], mask=tile_mask, other=0)
    pos = kv_len - q_len + tok
    # Keys this tile can see: up to its last token's position, from the window's start.
    visible_end = kv_len - q_len + jnp.minimum(q_start + st.tokens, q_len)
    num_pages = lax.div(jnp.maximum(visible_end, 0) + st.page_size - 1, st.page_size)
    first_page = jnp.int32(0)
    if st.window is not None:
        first_page = lax.div(jnp.maximum(kv_len - q_len + q_start - st.window + 1, 0), st.page_size)
    page_lo = jnp.maximum(first_page, split * st.pages_per_split)
    page_hi = jnp.minimum(num_pages, (split + 1) * st.pages_per_split)
    last_owned = bt_ref[s_idx, jnp.maximum(num_pages - 1, 0)]
    logit_scale = st.scale if st.softcap is not None else st.scale * LOG2E

    def body(j, carry):
        acc, m, l = carry
        page_idx = j * st.pages_per_tile + lax.broadcasted_iota(jnp.int32, (st.pages_per_tile,), 0)
        ids = bt_ref[s_idx, jnp.minimum(page_idx, max_pages - 1)]
        ids = jnp.where(page_idx < num_pages, ids, last_owned)  # never touch pages past the sequence
        k = _load_pages(k_ref, ids, st, q.dtype)
        v = _load_pages(v_ref, ids, st, q.dtype)
        s = dot(q, k, trans_b=True) * logit_scale
        v_scale = None
        if st.quantized:  # per-key scales on the logits and the probabilities: [keys], not [keys, D]
            s = s * ks_ref[ids].reshape(st.block_k)[None, :]
            v_scale = vs_ref[ids].reshape(st.block_k)
        if st.softcap is not None:
            s = st.softcap * jnp.tanh(s / st.softcap) * LOG2E
        kv_pos = j * st.block_k + lax.broadcasted_iota(jnp.int32, (st.block_k,), 0)
        in_split = (kv_pos >= page_lo * st.page_size) & (kv_pos < page_hi * st.page_size)
        mask = row_valid[:, None] & in_split[None, :] & (kv_pos[None, :] <= pos[:, None])
        if st.window is not None:
            mask &= pos[:, None] - kv_pos[None, :] < st.window
        return online_softmax_step(acc, m, l, jnp.where(mask, s, -jnp.inf), v, v_scale)

    init = (
        jnp.zeros((st.rows, d), jnp.float32),
        jnp.full((st.rows,), -jnp.inf, jnp.float32),
        jnp.zeros((st.rows,), jnp.float32),
    )
    j_lo = lax.div(page_lo, st.pages_per_tile)
    j_hi = jnp.maximum(lax.div(page_hi + st.pages_per_tile - 1, st.pages_per_tile), j_lo)
    acc, m, l = lax.fori_loop(j_lo, j_hi, body, init)
    empty = l == 0.0
    out = acc / jnp.where(empty, 1.0, l)[:, None]
    o_ref = out_refs[0]
    plgpu.store(o_ref.at[flat[:, None], cols[None, :]], out.astype(o_ref.dtype), mask=tile_mask)
    if len(out_refs) > 1:  # split-K: the partial's log-sum-exp (base 2) for the merge
        lse = jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))
        plgpu.store(out_refs[1].at[flat], lse, mask=row_valid)


def _max_tile_elements(head_dim: int, quantized: bool) -> int:
    """Rows x head_dim a tile may hold. int8/fp8 pages add their raw and converted [keys, head_dim]
    tiles and per-key scales: at head dim 256 that needs half the rows (else 24 B of spills per thread
    at 8 warps, sm_90a, with the scales on logits and probabilities)."""
    return MAX_TILE_ELEMENTS // (2 if quantized and head_dim >= 256 else 1)


def kernel_tile_tokens(group: int, head_dim: int, max_q_len: int, quantized: bool, block_q: int = BLOCK_Q) -> int:
    """New tokens per work tile for `group` query heads per KV head (1 for decode): what the host
    passes to kernel_work_list when it builds the work list itself."""
    rows_per_token = pl.next_power_of_2(group) * register_head_dim(head_dim)
    max_tokens = max(1, _max_tile_elements(head_dim, quantized) // rows_per_token)
    return max(1, min(block_q, pl.next_power_of_2(max_q_len), max_tokens))


def addressable_blocks(num_blocks: int, block_elements: int, itemsize: int) -> int:
    """The most blocks (up to num_blocks) of a pool that Triton addresses correctly."""
    size = num_blocks * block_elements
    if itemsize == 1 and MAX_I32_ELEMENTS < size <= 2**32:
        return MAX_I32_ELEMENTS // block_elements
    return num_blocks


def check_addressable(pool: jax.Array | jax.ShapeDtypeStruct) -> None:
    """Refuse a pool Triton would mis-address (see MAX_I32_ELEMENTS): 1-byte elements, more than
    2^31 of them, at most 2^32 bytes."""
    num_blocks, per_block, itemsize = pool.shape[0], math.prod(pool.shape[1:]), jnp.dtype(pool.dtype).itemsize
    limit = addressable_blocks(num_blocks, per_block, itemsize)
    if limit < num_blocks:
        raise ValueError(
            f"a {pool.dtype} KV pool of {num_blocks} blocks ({num_blocks * per_block} elements) would be "
            f"addressed with 32-bit offsets past 2^31 on the GPU: use at most {limit} blocks, or more than "
            f"{2**32 // (per_block * itemsize)}"
        )


def ragged_paged_attention(
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
    block_q: int = BLOCK_Q,
    pages_per_tile: int | None = None,
    num_splits: int = 1,
    work: Int[Array, "T 2"] | None = None,
    interpret: bool | None = None,
) -> Float[Array, "N H D"]:
    """Same contract as `ragged_paged_attention_reference`; at most `block_q` new tokens per work
    tile. `work` (kernel_work_list with `kernel_tile_tokens` tokens, built on the host) may be given."""
    n, h, d = q.shape
    nb, bs, kh, dk = k_pool.shape
    s, mb = block_tables.shape
    if dk != d or v_pool.shape != k_pool.shape:
        raise ValueError(f"q {q.shape}, k_pool {k_pool.shape}, v_pool {v_pool.shape}: head dims/pools differ")
    if h % kh:
        raise ValueError(f"num query heads {h} must be a multiple of num kv heads {kh}")
    if bs & (bs - 1):
        raise ValueError(f"block_size ({bs}) must be a power of two")
    if (k_scales is None) != (v_scales is None) or (k_scales is None) == is_quantized_kv(k_pool.dtype):
        raise ValueError("int8/fp8 pools need k_scales and v_scales; float pools take none")
    check_addressable(k_pool)
    if cu_q_lens.shape != (s + 1,) or kv_lens.shape != (s,):
        raise ValueError(f"cu_q_lens {cu_q_lens.shape} / kv_lens {kv_lens.shape} do not match {s} sequences")
    tokens = kernel_tile_tokens(h // kh, d, max_q_len or n, k_scales is not None, block_q)
    group_pad = max(pl.next_power_of_2(h // kh), 16 // tokens)  # a tile needs >= 16 rows for the MMA
    num_warps = 8 if tokens * group_pad * register_head_dim(d) >= MAX_TILE_ELEMENTS // 2 else 4
    if pages_per_tile is None:
        pages_per_tile = max(1, KEYS_PER_STEP // bs)
    pages_per_tile = min(pages_per_tile, pl.next_power_of_2(mb))
    pages_per_split = pages_per_tile * pl.cdiv(pl.cdiv(mb, num_splits), pages_per_tile)
    st = _Static(
        tokens=tokens,
        group=h // kh,
        group_pad=group_pad,
        num_heads=h,
        page_size=bs,
        pages_per_tile=pages_per_tile,
        pages_per_split=pages_per_split,
        window=sliding_window,
        softcap=logit_softcap,
        scale=d**-0.5 if scale is None else float(scale),
        quantized=k_scales is not None,
        head_dim=d,
    )
    if interpret is None:
        interpret = jax.default_backend() != "gpu"

    cu_q_lens = cu_q_lens.astype(jnp.int32)
    if work is None:
        work = kernel_work_list(cu_q_lens, n, tokens)
    elif work.shape != (max_work_tiles(n, s + 1, tokens), 2):
        raise ValueError(f"work {work.shape} is not kernel_work_list(cu_q_lens, {n}, {tokens}) for {s} sequences")
    if k_scales is None:
        k_scales = v_scales = jnp.ones((1, 1, kh), jnp.float32)
    whole = lambda shape: pl.BlockSpec(shape, lambda t, g, c: (0,) * len(shape))
    sq = pl.squeezed
    pool_spec = pl.BlockSpec((nb, bs, sq, d), lambda t, g, c: (0, 0, g, 0))
    scale_spec = pl.BlockSpec((k_scales.shape[0], k_scales.shape[1], sq), lambda t, g, c: (0, 0, g))
    rows = n * h
    if num_splits == 1:  # the result itself, in the query dtype
        out_specs = [whole((rows, d))]
        out_shape = [jax.ShapeDtypeStruct((rows, d), q.dtype)]
    else:  # float32 partials and their log-sum-exp, merged by a second small kernel
        out_specs = [
            pl.BlockSpec((sq, rows, d), lambda t, g, c: (c, 0, 0)),
            pl.BlockSpec((sq, rows), lambda t, g, c: (c, 0)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((num_splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, rows), jnp.float32),
        ]
    outs = pl.pallas_call(
        functools.partial(_kernel, st=st),
        grid=(work.shape[0], kh, num_splits),
        in_specs=[
            whole(work.shape),
            whole(cu_q_lens.shape),
            whole(kv_lens.shape),
            whole(block_tables.shape),
            whole((rows, d)),
            pool_spec,
            pool_spec,
            scale_spec,
            scale_spec,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=NUM_STAGES),
        interpret=interpret,
        name="jaxinfra_ragged_paged_attention",
    )(
        work,
        cu_q_lens,
        kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        q.reshape(rows, d),
        k_pool,
        v_pool,
        k_scales,
        v_scales,
    )
    out = outs[0] if num_splits == 1 else merge_splits(outs[0], outs[1], q.dtype, interpret=interpret)
    return out.reshape(n, h, d)
