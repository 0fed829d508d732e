"""FlashAttention-2 backward of flash_attention_mgpu in Mosaic GPU: two warp-specialized kernels that
recompute probabilities from the forward's base-2 log-sum-exp.

- dQ: the forward's shape. A program owns 128 query rows of one head (two consumer warpgroups of 64);
  the producer streams K/V tiles; each consumer takes S = QK^T, dP = dO V^T and dQ += dS K as wgmma.
- dK/dV: a program owns 128 keys of one K/V head (two consumers of 64); the producer streams the
  query tiles (Q, dO, log-sum-exp, delta) of every query head in the group, so the group's sum
  happens in the accumulators. Each consumer takes S^T = K Q^T, dV += P^T dO, dP^T = V dO^T and
  dK += dS^T Q, causal tiles past its diagonal skipped, masking only the ones that cross it.

delta = rowsum(dO * O) is one XLA reduction before the kernels.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu_ops import (
    CONSUMERS,
    ROWS,
    AttentionConfig,
    Ring,
    causal_mask,
    consumers,
    load_vector,
    mma_nn,
    mma_nt,
    query_program,
    query_scratch,
    ring_scratch,
    store_rows,
    tiled_smem,
    walk_kv,
    warp_specialized,
    zeros_acc,
)
from pallas_kernels.tile_ops import LOG2E

K, V = 0, 1  # the dQ ring's operands
Q, DO, LSE, DELTA = 0, 1, 2, 3  # the dK/dV ring's operands


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, q_smem, do_smem, vec_smem, bars, *scratch, cfg):
    """One program: 128 query rows of one head; warpgroup 2 keeps the K/V ring full."""
    program = query_program(k_ref, v_ref, scratch, cfg)
    ring, head, batch, wg = program.ring, program.head, program.batch, program.wg

    @consumers(wg)
    def _consumer():
        q0 = program.q0(cfg)
        rows = pl.ds(q0, ROWS)
        q_rows, do_rows = q_smem.at[wg], do_smem.at[wg]
        sources: tuple[Any, ...] = (q_ref.at[batch, rows, head], do_ref.at[batch, rows, head])
        sources += (lse_ref.at[batch, head, rows], delta_ref.at[batch, head, rows])
        for i, (src, dst) in enumerate(zip(sources, (q_rows, do_rows, vec_smem.at[0, wg], vec_smem.at[1, wg]))):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[i * CONSUMERS + wg])
        for i in range(len(sources)):
            plgpu.barrier_wait(bars.at[i * CONSUMERS + wg])
        lse, delta = (load_vector(vec_smem.at[i, wg], 1, cfg.interpret) for i in (0, 1))

        def body(step, dq, masked: bool):
            k_slot = ring.take(K, step)
            s = mma_nt(q_rows, k_slot, cfg.interpret) * (cfg.scale * LOG2E)
            if masked:
                s = causal_mask(s, q0, step * cfg.block_k, cfg)
            p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))
            dp = mma_nt(do_rows, ring.take(V, step), cfg.interpret)
            ring.release(V, step)
            ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [0]))
            dq = mma_nn(ds.astype(cfg.dtype), k_slot, program.a_scratch(), cfg.interpret, acc=dq)
            ring.release(K, step)
            return dq

        dq = walk_kv(ring, q0, program.steps, cfg, body, zeros_acc(cfg.head_dim, cfg.interpret))
        store_rows(dq * cfg.scale, q_rows, dq_ref.at[batch, rows, head])


def _query_tiles(k0: jax.Array, num_keys: int, num_tiles: int, cfg: AttentionConfig) -> tuple[jax.Array, jax.Array]:
    """The first query tile (of ROWS) that keys k0.. see, and the first that sees all of them (no mask);
    (num_tiles, num_tiles) for keys past the sequence (a program's second consumer at an odd end)."""
    past = k0 >= num_keys
    if not cfg.causal:
        first = jnp.where(past, num_tiles, 0)
        return first, first
    first = jnp.where(past, num_tiles, jnp.clip(lax.div(k0 - cfg.offset, ROWS), 0, num_tiles))
    full = jnp.clip(lax.div(k0 + 2 * (ROWS - 1) - cfg.offset, ROWS), first, num_tiles)
    return first, full


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, k_smem, v_smem, bars, *scratch, cfg):
    """One program: 128 keys of one K/V head; warpgroup 2 streams every query head's tiles."""
    ring = Ring.of(scratch[:12], cfg.stages)
    p_smem = scratch[12] if cfg.interpret else None
    tile, kv_head, batch, wg = (lax.axis_index(name) for name in ("k", "kv_heads", "batch", "wg"))
    num_keys, num_tiles = k_ref.shape[1], q_ref.shape[1] // ROWS
    first0, _ = _query_tiles(tile * CONSUMERS * ROWS, num_keys, num_tiles, cfg)  # the earlier consumer's
    per_head = num_tiles - first0  # ring steps per query head

    @pl.when(wg == CONSUMERS)
    def _producer():
        def tiles(step):
            head = kv_head * cfg.group + lax.div(step, per_head)
            rows = pl.ds((first0 + lax.rem(step, per_head)) * ROWS, ROWS)
            return (
                q_ref.at[batch, rows, head],
                do_ref.at[batch, rows, head],
                lse_ref.at[batch, head, rows],
                delta_ref.at[batch, head, rows],
            )

        ring.fill(tiles, cfg.group * per_head)

    @consumers(wg)
    def _consumer():
        k0 = tile * CONSUMERS * ROWS + wg * ROWS
        first, full = _query_tiles(k0, num_keys, num_tiles, cfg)
        rows = pl.ds(k0, ROWS)
        k_rows, v_rows = k_smem.at[wg], v_smem.at[wg]
        scratch_p = None if p_smem is None else p_smem.at[wg]

        @pl.when(k0 < num_keys)
        def _load():
            for i, (src, dst) in enumerate(((k_ref, k_rows), (v_ref, v_rows))):
                plgpu.copy_gmem_to_smem(src.at[batch, rows, kv_head], dst, bars.at[i * CONSUMERS + wg])
                plgpu.barrier_wait(bars.at[i * CONSUMERS + wg])

        def body(i, carry, base, masked: bool):
            dk, dv = carry
            step = base + i
            q_slot, do_slot = ring.take(Q, step), ring.take(DO, step)
            s = mma_nt(k_rows, q_slot, cfg.interpret) * (cfg.scale * LOG2E)  # [keys, queries]
            if masked:
                s = causal_mask(s, i * ROWS, k0, cfg, keys_on_rows=True)
            lse = ring.load_vector(LSE, step, 0, cfg.interpret)
            p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [1]))
            dv = mma_nn(p.astype(cfg.dtype), do_slot, scratch_p, cfg.interpret, acc=dv)
            dp = mma_nt(v_rows, do_slot, cfg.interpret)
            ring.release(DO, step)
            delta = ring.load_vector(DELTA, step, 0, cfg.interpret)
            ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [1]))
            dk = mma_nn(ds.astype(cfg.dtype), q_slot, scratch_p, cfg.interpret, acc=dk)
            ring.release(Q, step)
            return dk, dv

        def head_pass(g, carry):
            base = g * per_head - first0  # the ring step of query tile i of this head
            lax.fori_loop(first0, first, lambda i, c: ring.skip(base + i, c), None)
            carry = lax.fori_loop(first, full, functools.partial(body, base=base, masked=True), carry)
            return lax.fori_loop(full, num_tiles, functools.partial(body, base=base, masked=False), carry)

        zeros = zeros_acc(cfg.head_dim, cfg.interpret)
        dk, dv = lax.fori_loop(0, cfg.group, head_pass, (zeros, zeros))

        @pl.when(k0 < num_keys)
        def _store():
            store_rows(dk * cfg.scale, k_rows, dk_ref.at[batch, rows, kv_head])
            store_rows(dv, v_rows, dv_ref.at[batch, rows, kv_head])


def _dq(q, k, v, do, lse, delta, cfg: AttentionConfig, params: Any) -> jax.Array:
    b, t, h, d = q.shape
    return warp_specialized(
        functools.partial(_dq_kernel, cfg=cfg),
        params,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=[
            *[tiled_smem((CONSUMERS, ROWS, d), q.dtype)] * 2,
            plgpu.SMEM((2, CONSUMERS, ROWS), jnp.float32),
            plgpu.Barrier(num_arrivals=1, num_barriers=4 * CONSUMERS),
            *query_scratch(d, q.dtype, cfg),
        ],
        grid=(t // cfg.block_q, h, b),
        grid_names=("q", "heads", "batch"),
        kernel_name="jaxinfra_flash_dq_mgpu",
    )(q, k, v, do, lse, delta)


def _dkdv(q, k, v, do, lse, delta, cfg: AttentionConfig, params: Any) -> tuple[jax.Array, jax.Array]:
    b, s, kh, d = k.shape
    tiles = [((ROWS, d), q.dtype)] * 2 + [((ROWS,), jnp.float32)] * 2
    return warp_specialized(
        functools.partial(_dkdv_kernel, cfg=cfg),
        params,
        out_type=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        scratch_types=[
            *[tiled_smem((CONSUMERS, ROWS, d), q.dtype)] * 2,
            plgpu.Barrier(num_arrivals=1, num_barriers=2 * CONSUMERS),
            *ring_scratch(tiles, cfg.stages),
            *([tiled_smem((CONSUMERS, ROWS, ROWS), q.dtype)] if cfg.interpret else []),
        ],
        grid=(pl.cdiv(s, CONSUMERS * ROWS), kh, b),
        grid_names=("k", "kv_heads", "batch"),
        kernel_name="jaxinfra_flash_dkdv_mgpu",
    )(q, k, v, do, lse, delta)


def flash_backward_mgpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    do: jax.Array,
    cfg: AttentionConfig,
    params: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dQ, dK, dV of flash_attention_mgpu from its residuals (`lse`: [B, H, T] base-2 log-sum-exp)."""
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), do.astype(jnp.float32))
    do = do.astype(q.dtype)
    dk, dv = _dkdv(q, k, v, do, lse, delta, cfg, params)
    return _dq(q, k, v, do, lse, delta, cfg, params), dk, dv
