"""Pieces the flash attention forward (flash_attention.py) and backward (flash_backward.py) share:
tile sizes, the trace-time static description, the masked logits of one tile pair, which tiles a
tile can see, loads and stores at the true head dim, and the padding and BlockSpecs of the pallas_calls.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tile_ops import LOG2E, dot, head_cols, register_head_dim


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


def default_block_sizes(head_dim: int, traced_offset: bool = False) -> BlockSizes:
    """The tiles for a head dim. With a traced query offset (context parallelism) the backward takes
    at most 32 query rows above head dim 64: its mask arithmetic took dK/dV at d 128 and 64 rows to
    255 registers and 8 B of spills on sm_90a, and 32 rows compile to 172 registers and none."""
    blocks = next((DEFAULT_BLOCK_SIZES[d] for d in sorted(DEFAULT_BLOCK_SIZES) if head_dim <= d), None)
    blocks = blocks or DEFAULT_BLOCK_SIZES[max(DEFAULT_BLOCK_SIZES)]
    if traced_offset and head_dim > 64:
        return dataclasses.replace(blocks, block_q_bwd=min(blocks.block_q_bwd, 32))
    return blocks


@dataclasses.dataclass(frozen=True)
class FlashStatic:
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
    head_dim: int  # true width of q, k, v and every gradient

    @property
    def rows(self) -> int:
        return self.tokens * self.group

    @property
    def head_dim_pad(self) -> int:
        return register_head_dim(self.head_dim)


def _tile_index(ref, first: jax.Array | int, n: int, st: FlashStatic) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """Gather indices of ref[first:first + n] (2 or 3 dims) padded to head_dim_pad columns, and the
    mask of the columns that exist."""
    cols, col_valid = head_cols(st.head_dim)
    inner = ref.shape[1:-1]
    axes = [first + lax.broadcasted_iota(jnp.int32, (n,), 0)]
    axes += [lax.broadcasted_iota(jnp.int32, (size,), 0) for size in inner] + [cols]
    rank = len(axes)
    idx = tuple(a.reshape((1,) * i + (-1,) + (1,) * (rank - 1 - i)) for i, a in enumerate(axes))
    return idx, col_valid.reshape((1,) * (rank - 1) + (-1,))


def load_tile(ref, first: jax.Array | int, n: int, st: FlashStatic) -> jax.Array:
    """ref[first:first + n] with its last axis padded to head_dim_pad with zeros in registers only
    (head dims 80, 96 read at their true width; zero columns change no dot product)."""
    if st.head_dim == st.head_dim_pad:
        return ref[pl.ds(first, n)]
    idx, cols = _tile_index(ref, first, n, st)
    return plgpu.load(ref.at[idx], mask=cols, other=0)


def store_tile(ref, first: jax.Array | int, x: jax.Array, st: FlashStatic) -> None:
    """ref[first:first + len(x)] = x, dropping the register padding past the true head dim."""
    if st.head_dim == st.head_dim_pad:
        ref[pl.ds(first, x.shape[0])] = x.astype(ref.dtype)
        return
    idx, cols = _tile_index(ref, first, x.shape[0], st)
    plgpu.store(ref.at[idx], x.astype(ref.dtype), mask=cols)


def row_tokens(tok0: jax.Array, st: FlashStatic) -> jax.Array:
    return tok0 + lax.broadcasted_iota(jnp.int32, (st.rows,), 0) // st.group


def tile_rows(x: jax.Array, st: FlashStatic) -> jax.Array:
    """[tokens, group, ...] tile -> [rows, ...]."""
    return x.reshape(st.rows, *x.shape[2:])


def row_segments(seg: jax.Array, st: FlashStatic) -> jax.Array:
    return jnp.broadcast_to(seg[:, None], (st.tokens, st.group)).reshape(st.rows)


def logits(q: jax.Array, k: jax.Array, st: FlashStatic) -> jax.Array:
    """Scaled (and soft-capped) natural logits [rows, block_k], unmasked."""
    s = dot(q, k, trans_b=True) * st.scale
    return s if st.softcap is None else st.softcap * jnp.tanh(s / st.softcap)


def masked_scores(
    q: jax.Array,
    k: jax.Array,
    q_tok: jax.Array,
    kv0: jax.Array,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    offset: jax.Array,
    st: FlashStatic,
) -> tuple[jax.Array, jax.Array]:
    """Masked base-2 logits [rows, block_k] and the capped natural logits (for the softcap grad)."""
    s = logits(q, k, st)
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


def kv_range(
    tok0: jax.Array, tokens: int, num_kv_blocks: int, offset: jax.Array, st: FlashStatic
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


def full_kv_end(tok0: jax.Array, lo: jax.Array, hi: jax.Array, offset: jax.Array, st: FlashStatic) -> jax.Array:
    """End of the kv tiles in [lo, hi) that need no mask for a query tile from token tok0: every key
    real and (causal) at or before the tile's first query. With a window or segments, none."""
    if st.window is not None or st.has_segments:
        return lo
    end = jnp.int32(st.kv_len // st.block_k)
    if st.causal:
        end = jnp.minimum(end, lax.div(jnp.maximum(tok0 + offset + 1, 0), st.block_k))
    return jnp.clip(end, lo, hi)


def q_range(
    kv0: jax.Array, block_k: int, num_q_blocks: int, offset: jax.Array, st: FlashStatic
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


def group_tile(group: int) -> int:
    """Largest power of two dividing the GQA ratio: heads packed into one tile."""
    return group & -group


def pad_to(x: jax.Array, axis: int, multiple: int, value: int | float = 0) -> jax.Array:
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def block_specs(
    st: FlashStatic, tq: int, tk: int, d: int, nc: int, *, q_tiled: bool, kv_tiled: bool, reverse: bool = False
):
    """BlockSpecs over grid (batch, head-chunk, tile). q/k tiles or whole sequences per program;
    `reverse`: program i of the tile axis takes the last query tile minus i (see q_tile_index)."""
    sq = pl.squeezed

    def q_index(i):
        return (tq // st.tokens - 1 - i if reverse else i) if q_tiled else 0

    def q_map(b, h, i):
        return (b, q_index(i), h, 0, 0)

    def kv_map(b, h, i):
        return (b, i if kv_tiled else 0, h // nc, 0)

    q_len = st.tokens if q_tiled else tq
    kv_len = st.block_k if kv_tiled else tk
    q_spec = pl.BlockSpec((sq, q_len, sq, st.group, d), q_map)
    row_spec = pl.BlockSpec((sq, q_len, sq, st.group), lambda b, h, i: q_map(b, h, i)[:4])
    kv_spec = pl.BlockSpec((sq, kv_len, sq, d), kv_map)
    qseg_spec = pl.BlockSpec((sq, q_len), lambda b, h, i: (b, q_index(i)))
    kvseg_spec = pl.BlockSpec((sq, kv_len), lambda b, h, i: (b, i if kv_tiled else 0))
    return q_spec, row_spec, kv_spec, qseg_spec, kvseg_spec


OFFSET_SPEC = pl.BlockSpec((1,), lambda *_: (0,))  # a traced query offset, one int32 read by every program


def read_offset(off_ref, st: FlashStatic):
    """The query offset: a compile-time constant unless it was traced."""
    return off_ref[0] if st.offset is None else st.offset


def prepare(q, k, v, q_seg, kv_seg, st: FlashStatic, block_k: int):
    """Pad lengths to tile multiples and view q as [B, T, head-chunks, group, D]."""
    b, t, h, d = q.shape
    kh = k.shape[2]
    nc = h // st.group
    qp = pad_to(q, 1, st.tokens).reshape(b, -1, nc, st.group, d)
    kp, vp = pad_to(k, 1, block_k), pad_to(v, 1, block_k)
    if q_seg is None:
        q_seg, kv_seg = jnp.zeros((b, t), jnp.int32), jnp.zeros((b, k.shape[1]), jnp.int32)
    q_seg = pad_to(q_seg.astype(jnp.int32), 1, st.tokens)
    kv_seg = pad_to(kv_seg.astype(jnp.int32), 1, block_k)
    return qp, kp, vp, q_seg, kv_seg, nc // kh
