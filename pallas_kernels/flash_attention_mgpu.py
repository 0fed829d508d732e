"""Flash attention for Hopper in Pallas' Mosaic GPU dialect: TMA copies, wgmma, warp specialization.

A forward program owns 128 query rows of one head, split between two consumer warpgroups (64 rows
each: a wgmma's M); a third, producer warpgroup gives up its registers to them and keeps a ring of
`stages` K/V tiles in shared memory full by TMA (mgpu_ops.Ring). Each consumer copies its Q rows once,
takes QK^T and PV as wgmma (P from registers, K transposed in place) with an online base-2 softmax,
stops at its causal diagonal (masking only the tiles that cross it; the earlier consumer still
releases the tiles only the later one reads), and writes its rows and their log-sum-exp back by TMA.
The backward (flash_backward_mgpu) recomputes probabilities from that log-sum-exp. Selected as
`impl="mosaic"`.

Off a GPU it runs under Mosaic GPU's interpreter (`interpret=True`), which is how CI checks it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float

from pallas_kernels.flash_backward_mgpu import flash_backward_mgpu
from pallas_kernels.mgpu_ops import (
    CONSUMERS,
    ROWS,
    AttentionConfig,
    causal_mask,
    consumers,
    in_layout,
    mma_nn,
    mma_nt,
    query_program,
    query_scratch,
    store_rows,
    tiled_smem,
    walk_kv,
    warp_specialized,
    zeros_acc,
)
from pallas_kernels.tile_ops import LOG2E

K, V = 0, 1  # the ring's operands


@dataclasses.dataclass(frozen=True)
class MosaicBlocks:
    """Tile sizes: query rows per program (two consumer warpgroups of 64: 128), keys per pipelined step,
    and the K/V ring's slots."""

    block_q: int = 128
    block_k: int = 64
    stages: int = 2

    def __post_init__(self) -> None:
        if self.block_q != CONSUMERS * ROWS or self.block_k % 64 or self.block_k <= 0:
            raise ValueError(f"MosaicBlocks: block_q must be 128 and block_k a multiple of 64, got {self}")
        if self.stages < 2:
            raise ValueError(f"MosaicBlocks.stages must be >= 2, got {self.stages}")


def _kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem, lse_smem, q_bars, *scratch, cfg: AttentionConfig):
    """One program: 128 query rows of one head. Warpgroups 0 and 1 compute 64 rows each; warpgroup 2
    keeps the K/V ring full."""
    program = query_program(k_ref, v_ref, scratch, cfg)
    ring, head, batch, wg = program.ring, program.head, program.batch, program.wg

    @consumers(wg)
    def _consumer():
        q0 = program.q0(cfg)
        q_rows = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q0, ROWS), head], q_rows, q_bars.at[wg])
        plgpu.barrier_wait(q_bars.at[wg])

        def body(step, carry, masked: bool):
            acc, m, l = carry
            s = mma_nt(q_rows, ring.take(K, step), cfg.interpret) * (cfg.scale * LOG2E)
            ring.release(K, step)
            if masked:
                s = causal_mask(s, q0, step * cfg.block_k, cfg)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that saw no key yet stays all zero
            p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            alpha = jnp.exp2(m - m_safe)
            l = l * alpha + p.sum(axis=1)
            pv = mma_nn(p.astype(cfg.dtype), ring.take(V, step), program.a_scratch(), cfg.interpret)
            ring.release(V, step)
            return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_new, l

        rows_layout = plgpu.Layout.WGMMA.reduce(1)
        init = (
            zeros_acc(cfg.head_dim, cfg.interpret),
            in_layout(jnp.full((ROWS,), -jnp.inf, jnp.float32), rows_layout, cfg.interpret),
            in_layout(jnp.zeros((ROWS,), jnp.float32), rows_layout, cfg.interpret),
        )
        acc, m, l = walk_kv(ring, q0, program.steps, cfg, body, init)
        empty = l == 0.0  # rows that see no key (a causal offset < 0): output 0, lse +inf so backward p = 0
        l = jnp.where(empty, 1.0, l)
        store_rows(acc / lax.broadcast_in_dim(l, acc.shape, [0]), q_rows, o_ref.at[batch, pl.ds(q0, ROWS), head])
        lse = jnp.where(empty, jnp.inf, m + jnp.log2(l))
        store_rows(lse, lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(q0, ROWS)])


def _forward(
    q: jax.Array, k: jax.Array, v: jax.Array, cfg: AttentionConfig, params: Any
) -> tuple[jax.Array, jax.Array]:
    """The output [B, T, H, D] and its base-2 log-sum-exp [B, H, T] (float32)."""
    b, t, h, d = q.shape
    return warp_specialized(
        functools.partial(_kernel, cfg=cfg),
        params,
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t), jnp.float32)),
        scratch_types=[
            tiled_smem((CONSUMERS, ROWS, d), q.dtype),
            plgpu.SMEM((CONSUMERS, ROWS), jnp.float32),
            plgpu.Barrier(num_arrivals=1, num_barriers=CONSUMERS),
            *query_scratch(d, q.dtype, cfg),
        ],
        grid=(t // cfg.block_q, h, b),
        grid_names=("q", "heads", "batch"),
        kernel_name="jaxinfra_flash_fwd_mgpu",
    )(q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q: jax.Array, k: jax.Array, v: jax.Array, cfg: AttentionConfig, params: Any) -> jax.Array:
    return _forward(q, k, v, cfg, params)[0]


def _attention_fwd(q, k, v, cfg, params):
    out, lse = _forward(q, k, v, cfg, params)
    return out, (q, k, v, out, lse)


def _attention_bwd(cfg, params, residuals, do):
    q, k, v, out, lse = residuals
    return flash_backward_mgpu(q, k, v, out, lse, do, cfg, params)


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention_mgpu(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S KH D"],
    v: Float[Array, "B S KH D"],
    *,
    causal: bool = True,
    scale: float | None = None,
    blocks: MosaicBlocks | None = None,
    interpret: Any = None,
) -> Float[Array, "B T H D"]:
    """Attention with the reference's semantics (queries aligned to the end of the keys), bf16 or
    f16, head dim 64 or 128, T a multiple of 128 and S of block_k. `interpret` (default: off GPU)
    runs Mosaic GPU's interpreter, with its InterpretGPUParams if one is given (race detection)."""
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    blocks = blocks or MosaicBlocks()
    if k.shape != (b, s, kh, d) or v.shape != k.shape:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: expected [B,T,H,D], [B,S,KH,D] x2")
    if h % kh:
        raise ValueError(f"num query heads {h} must be a multiple of num kv heads {kh}")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a 16-bit float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if d not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128, got {d}")
    if t % blocks.block_q or s % blocks.block_k:
        raise ValueError(f"T ({t}) must be a multiple of {blocks.block_q} and S ({s}) of {blocks.block_k}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    interpret_params = _interpreter() if interpret is True else interpret or None
    cfg = AttentionConfig(
        causal=causal,
        scale=d**-0.5 if scale is None else float(scale),
        offset=s - t,
        group=h // kh,
        block_q=blocks.block_q,
        block_k=blocks.block_k,
        stages=min(blocks.stages, s // blocks.block_k),
        num_steps=s // blocks.block_k,
        head_dim=d,
        dtype=q.dtype,
        interpret=interpret_params is not None,
    )
    return _attention(q, k, v, cfg, interpret_params)


def _interpreter() -> Any:
    """Mosaic GPU's CPU interpreter (simulated shared memory, barriers and TMA)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
