"""Flash attention forward for Hopper in Pallas' Mosaic GPU dialect: TMA copies, wgmma, warp specialization.

A program owns 128 query rows of one head, split between two consumer warpgroups (64 rows each: a
wgmma's M); a third, producer warpgroup gives up its registers to them and keeps a ring of `stages`
K/V tiles in shared memory full by TMA, refilling a slot once both consumers have released it (a
barrier each for K and V). Each consumer copies its Q rows once, takes QK^T and PV as wgmma (P from
registers, K transposed in place) with an online base-2 softmax, stops at its causal diagonal
(masking only the tiles that cross it; the earlier consumer still releases the tiles only the later
one reads), and writes its rows back by TMA. Inference only (no backward); selected as `impl="mosaic"`.

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

from pallas_kernels.tile_ops import LOG2E

SWIZZLE = 128  # bytes: the widest swizzle, for 64 bf16 columns a row segment
CONSUMERS = 2  # warpgroups that compute, 64 query rows each (wgmma's M)
CONSUMER_ROWS = 64
CONSUMER_REGISTERS = 232  # per thread: the consumers take what the producer gives up
PRODUCER_REGISTERS = 40


@dataclasses.dataclass(frozen=True)
class MosaicBlocks:
    """Tile sizes: query rows per program (two consumer warpgroups of 64: 128), keys per pipelined step,
    and the K/V ring's slots."""

    block_q: int = 128
    block_k: int = 64
    stages: int = 2

    def __post_init__(self) -> None:
        if self.block_q != CONSUMERS * CONSUMER_ROWS or self.block_k % 64 or self.block_k <= 0:
            raise ValueError(f"MosaicBlocks: block_q must be 128 and block_k a multiple of 64, got {self}")
        if self.stages < 2:
            raise ValueError(f"MosaicBlocks.stages must be >= 2, got {self.stages}")


def _smem(shape: tuple[int, ...], dtype: jnp.dtype) -> Any:
    """Shared memory laid out for TMA and wgmma: 8-row x 64-column tiles, 128-byte swizzle."""
    tiling = plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dtype).itemsize))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(SWIZZLE)))


def _visible_steps(q0: jax.Array, cfg: _Config) -> tuple[jax.Array, jax.Array]:
    """K/V tiles 64 queries from q0 can see, and how many of them need no mask."""
    if not cfg.causal:
        return jnp.int32(cfg.num_steps), jnp.int32(cfg.num_steps)
    last = q0 + CONSUMER_ROWS + cfg.offset  # one past the last visible key
    steps = jnp.clip(lax.div(last + cfg.block_k - 1, cfg.block_k), 0, cfg.num_steps)
    return steps, jnp.clip(lax.div(q0 + cfg.offset + 1, cfg.block_k), 0, steps)


def _kernel(q_ref, k_ref, v_ref, o_ref, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, k_free, v_free, *p_smem, cfg):
    """One program: 128 query rows of one head. Warpgroups 0 and 1 compute 64 rows each; warpgroup 2
    keeps the K/V ring full, refilling a slot once both consumers have released it."""
    tile, head, batch, wg = (lax.axis_index(name) for name in ("q", "heads", "batch", "wg"))
    kv_head = lax.div(head, cfg.group)
    program_steps, _ = _visible_steps(tile * cfg.block_q + CONSUMER_ROWS, cfg)  # the later consumer's

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        def load(step, carry):
            slot = lax.rem(step, cfg.stages)
            rows = pl.ds(step * cfg.block_k, cfg.block_k)
            for ref, smem, ready, free in ((k_ref, k_smem, k_bars, k_free), (v_ref, v_smem, v_bars, v_free)):

                @pl.when(step >= cfg.stages)  # the slot's previous tile released by both consumers
                def _wait(free=free):
                    plgpu.barrier_wait(free.at[slot])

                plgpu.copy_gmem_to_smem(ref.at[batch, rows, kv_head], smem.at[slot], ready.at[slot])
            return carry

        def drain(step, carry):  # the last tiles' releases: every phase of a barrier is waited for
            for free in (k_free, v_free):
                plgpu.barrier_wait(free.at[lax.rem(step, cfg.stages)])
            return carry

        lax.fori_loop(0, program_steps, load, None)
        lax.fori_loop(jnp.maximum(program_steps - cfg.stages, 0), program_steps, drain, None)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        q0 = tile * cfg.block_q + wg * CONSUMER_ROWS
        steps, full = _visible_steps(q0, cfg)
        q_rows = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q0, CONSUMER_ROWS), head], q_rows, q_bars.at[wg])
        plgpu.barrier_wait(q_bars.at[wg])

        def body(step, carry, masked: bool):
            acc, m, l = carry
            slot = lax.rem(step, cfg.stages)
            plgpu.barrier_wait(k_bars.at[slot])
            s = _scores(q_rows, k_smem.at[slot], cfg) * (cfg.scale * LOG2E)
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                rows, cols = (_iota(s.shape, axis, cfg) for axis in (0, 1))
                s = jnp.where(q0 + rows + cfg.offset >= step * cfg.block_k + cols, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that saw no key yet stays all zero
            p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            alpha = jnp.exp2(m - m_safe)
            l = l * alpha + p.sum(axis=1)
            plgpu.barrier_wait(v_bars.at[slot])
            pv = _values(p.astype(cfg.dtype), v_smem.at[slot], [buf.at[wg] for buf in p_smem], cfg)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_new, l

        def release(step, carry):
            """A tile only the other consumer needs: taken (so that it was loaded) and released."""
            slot = lax.rem(step, cfg.stages)
            for ready, free in ((k_bars, k_free), (v_bars, v_free)):
                plgpu.barrier_wait(ready.at[slot])
                plgpu.barrier_arrive(free.at[slot])
            return carry

        rows_layout = plgpu.Layout.WGMMA.reduce(1)
        init = (
            _in_layout(jnp.zeros((CONSUMER_ROWS, cfg.head_dim), jnp.float32), plgpu.Layout.WGMMA, cfg),
            _in_layout(jnp.full((CONSUMER_ROWS,), -jnp.inf, jnp.float32), rows_layout, cfg),
            _in_layout(jnp.zeros((CONSUMER_ROWS,), jnp.float32), rows_layout, cfg),
        )
        carry = lax.fori_loop(0, full, functools.partial(body, masked=False), init)
        acc, _, l = lax.fori_loop(full, steps, functools.partial(body, masked=True), carry)
        lax.fori_loop(steps, program_steps, release, None)
        l = jnp.where(l == 0.0, 1.0, l)  # rows that see no key (a causal offset < 0): output 0
        q_rows[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(cfg.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_rows, o_ref.at[batch, pl.ds(q0, CONSUMER_ROWS), head])
        plgpu.wait_smem_to_gmem(0)


def _scores(q_smem, k_slot, cfg: _Config) -> jax.Array:
    """Q K^T [64, block_k] in float32: a wgmma reading K transposed in place. Interpreters before jax
    0.12 cannot transpose a shared-memory operand, so under them the product is taken from registers."""
    if cfg.interpret and jax.__version_info__ < (0, 12):
        return lax.dot_general(q_smem[...], k_slot[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def product(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_slot, (1, 0)))
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC((CONSUMER_ROWS, cfg.block_k), jnp.float32))


def _values(p: jax.Array, v_slot, p_smem: list, cfg: _Config) -> jax.Array:
    """P V [64, head_dim] in float32: a wgmma with P from registers. The interpreter takes wgmma
    operands from shared memory only, so there P goes through the one buffer in `p_smem`."""
    a = p
    if cfg.interpret:
        (a,) = p_smem
        a[...] = p

    def product(acc_ref):
        plgpu.wgmma(acc_ref, a, v_slot)
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC((CONSUMER_ROWS, cfg.head_dim), jnp.float32))


def _in_layout(x: jax.Array, layout: Any, cfg: _Config) -> jax.Array:
    """x in the register layout wgmma's accumulators use (the interpreter has no layouts)."""
    return x if cfg.interpret else plgpu.layout_cast(x, layout)


def _iota(shape: tuple[int, ...], axis: int, cfg: _Config) -> jax.Array:
    """Row or column indices of a wgmma accumulator."""
    if cfg.interpret:
        return lax.broadcasted_iota(jnp.int32, shape, axis)
    return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)


@dataclasses.dataclass(frozen=True)
class _Config:
    causal: bool
    scale: float
    offset: int  # query i sits at key position i + offset
    group: int  # query heads per K/V head
    block_q: int
    block_k: int
    stages: int
    num_steps: int  # K/V tiles of the whole sequence
    head_dim: int
    dtype: jnp.dtype
    interpret: bool  # run by Mosaic GPU's CPU interpreter


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
    cfg = _Config(
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
    return plgpu.kernel(
        functools.partial(_kernel, cfg=cfg),
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=[
            _smem((CONSUMERS, CONSUMER_ROWS, d), q.dtype),
            _smem((cfg.stages, cfg.block_k, d), q.dtype),
            _smem((cfg.stages, cfg.block_k, d), q.dtype),
            plgpu.Barrier(num_arrivals=1, num_barriers=CONSUMERS),
            plgpu.Barrier(num_arrivals=1, num_barriers=cfg.stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=cfg.stages),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=cfg.stages),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=cfg.stages),
            *([_smem((CONSUMERS, CONSUMER_ROWS, cfg.block_k), q.dtype)] if cfg.interpret else []),
        ],
        grid=(t // cfg.block_q, h, b),
        grid_names=("q", "heads", "batch"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        interpret=interpret_params,
        kernel_name="jaxinfra_flash_fwd_mgpu",
    )(q, k, v)


def _interpreter():
    """Mosaic GPU's CPU interpreter (simulated shared memory, barriers and TMA)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
