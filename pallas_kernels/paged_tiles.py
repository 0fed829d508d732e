"""Work tiles of a flat ragged token batch: shared by the Pallas kernel and the XLA formulation.

A work tile holds up to `tokens` new tokens of one sequence. `tile_plan` lays a batch out as tiles
with numpy (the serving runner builds it on the host, once per step for every layer) or with
jax.numpy (inside a jitted call when no plan was given); both run the same code.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int


def count_at_most(sorted_values: Any, queries: Any, xp: ModuleType = jnp) -> Any:
    """For each query, how many of the (ascending) sorted_values are <= it: searchsorted(side='right').
    Traced, it is one fused comparison (no sequential search loop: these arrays hold a few hundred entries)."""
    if xp is jnp:
        return jnp.sum(sorted_values[None, :] <= queries[:, None], axis=1, dtype=jnp.int32)
    return xp.searchsorted(sorted_values, queries, side="right")


def token_sequences(cu_q_lens: Any, n: int, xp: ModuleType = jnp) -> tuple[Any, Any, Any]:
    """For each of the n flat tokens: its sequence, its index among that sequence's new tokens, and
    whether it is a real token (not padding past cu_q_lens[-1])."""
    tok = xp.arange(n)
    seq = xp.minimum(count_at_most(cu_q_lens[1:], tok, xp), cu_q_lens.shape[0] - 2)
    return seq, tok - cu_q_lens[seq], tok < cu_q_lens[-1]


def max_work_tiles(n: int, s: int, tokens: int) -> int:
    """Tiles of `tokens` new tokens that n tokens over s sequences can need: sum(ceil(q_len / tokens))."""
    return max(1, min(n, (n + s * (tokens - 1)) // tokens))


def _tiles(q_lens: Any, tokens: int, num_tiles: int, xp: ModuleType) -> tuple[Any, Any, Any]:
    """Tiles of `tokens` new tokens over sequences of q_lens, in order: each tile's sequence (len(q_lens)
    for tiles past the work), its first token within that sequence, and each sequence's first tile."""
    per_seq = (q_lens + tokens - 1) // tokens
    first_tile = xp.cumsum(per_seq) - per_seq
    t = xp.arange(num_tiles)
    seq = count_at_most(first_tile + per_seq, t, xp)
    q_start = (t - first_tile[xp.minimum(seq, q_lens.shape[0] - 1)]) * tokens
    return seq, q_start, first_tile


def work_tiles(cu_q_lens: Any, kv_lens: Any, tokens: int, num_tiles: int, xp: ModuleType = jnp) -> tuple[Any, Any]:
    """[num_tiles, 4] int32 rows (seq, first new token, q_len, kv_len), unused tiles with q_len 0;
    and each sequence's first tile. `xp` is jax.numpy (traced) or numpy (host)."""
    s = kv_lens.shape[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    seq, q_start, first_tile = _tiles(q_lens, tokens, num_tiles, xp)
    valid = seq < s
    seq = xp.minimum(seq, s - 1)
    info = xp.stack(
        [seq, xp.where(valid, q_start, 0), xp.where(valid, q_lens[seq], 0), xp.where(valid, kv_lens[seq], 0)], axis=1
    ).astype(xp.int32)
    return info, first_tile


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Where each tile's rows come from and which pages it reads.

    q_index [T, tokens]: flat token of each tile row (-1: empty row); q_pos [T, tokens]: that
    token's position (-1: sees no key); pages [T, MB]: the tile's block-table row with columns
    past its sequence's last page pointing at that page (so no unowned page is ever read);
    out_index [N]: the tile row (t * tokens + r) each flat token's output comes from (-1: padding).
    """

    q_index: Int[Array, "T R"]
    q_pos: Int[Array, "T R"]
    pages: Int[Array, "T MB"]
    out_index: Int[Array, " N"]


def tile_plan(
    cu_q_lens: Any, kv_lens: Any, block_tables: Any, block_size: int, n: int, tokens: int, xp: ModuleType = jnp
) -> TilePlan:
    """Lay out n flat tokens (sequences per cu_q_lens) as max_work_tiles(n, S, tokens) tiles."""
    s, mb = block_tables.shape
    info, first_tile = work_tiles(cu_q_lens, kv_lens, tokens, max_work_tiles(n, s, tokens), xp)
    seq, q_start, q_len, kv_len = info[:, 0], info[:, 1], info[:, 2], info[:, 3]
    tok = q_start[:, None] + xp.arange(tokens)[None, :]
    valid = tok < q_len[:, None]
    q_index = xp.where(valid, cu_q_lens[seq][:, None] + tok, -1)
    q_pos = xp.where(valid, (kv_len - q_len)[:, None] + tok, -1)
    last_col = xp.maximum(kv_len - 1, 0) // block_size
    cols = xp.minimum(xp.arange(mb)[None, :], last_col[:, None])
    pages = xp.take_along_axis(block_tables[seq], cols, axis=1)
    tseq, local, real = token_sequences(cu_q_lens, n, xp)
    out_index = xp.where(real, (first_tile[tseq] + local // tokens) * tokens + local % tokens, -1)
    return TilePlan(*(a.astype(xp.int32) for a in (q_index, q_pos, pages, out_index)))


def kernel_work_list(cu_q_lens: Any, n: int, tokens: int, xp: ModuleType = jnp) -> Any:
    """The Pallas kernel's tiles: [T, 2] int32 rows (sequence, first new token within it), at most
    `tokens` tokens each, T = max_work_tiles(n, S + 1, tokens). The n - cu_q_lens[-1] padding tokens
    form one more sequence (index S, no keys: its tiles write zeros); tiles past the work have
    sequence S and a first token past n (they write nothing). Decode (tokens=1): tile t is token t."""
    s = cu_q_lens.shape[0] - 1
    q_lens = xp.concatenate([cu_q_lens[1:] - cu_q_lens[:-1], xp.asarray([n], cu_q_lens.dtype) - cu_q_lens[-1:]])
    seq, q_start, _ = _tiles(q_lens, tokens, max_work_tiles(n, s + 1, tokens), xp)
    return xp.stack([xp.minimum(seq, s), q_start], axis=1).astype(xp.int32)
