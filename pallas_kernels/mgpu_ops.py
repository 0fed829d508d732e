"""Pieces the Mosaic GPU attention kernels (forward, dQ, dK/dV) share: shared memory laid out for TMA and
wgmma, the two wgmma product forms, accumulator layouts, a producer-filled ring of tiles, the causal
mask, and the program structure (one producer warpgroup, two consumers; a query-side program's K/V walk).

Every piece also runs under Mosaic GPU's CPU interpreter, which lacks some operand forms: there a
wgmma's register operand goes through a shared-memory scratch, and before jax 0.12 a transposed
shared-memory operand is taken from registers instead.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SWIZZLE = 128  # bytes: the widest swizzle, for 64 bf16 columns a row segment
ROWS = 64  # rows a consumer warpgroup owns: wgmma's M
CONSUMERS = 2  # warpgroups that compute; a third one, the producer, fills the ring
CONSUMER_REGISTERS = 232  # per thread: the consumers take what the producer gives up
PRODUCER_REGISTERS = 40
_LOAD_TAKES_INDEX = "idx" in inspect.signature(plgpu.load).parameters  # jax < 0.12


def tiled_smem(shape: tuple[int, ...], dtype: Any) -> Any:
    """Shared memory for TMA and wgmma: 8-row x 64-column tiles, 128-byte swizzle."""
    tiling = plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dtype).itemsize))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(SWIZZLE)))


def in_layout(x: jax.Array, layout: Any, interpret: bool) -> jax.Array:
    """x in the register layout wgmma's accumulators use (the interpreter has no layouts)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def iota(shape: tuple[int, ...], axis: int, interpret: bool) -> jax.Array:
    """Row or column indices of a wgmma accumulator."""
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, axis)
    return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)


def load_vector(ref: Any, along: int, interpret: bool) -> jax.Array:
    """A [ROWS] float32 vector from shared memory, laid out to broadcast along accumulator axis
    `along` (1: one value per row, 0: one per column)."""
    if interpret:
        return ref[...]
    index: tuple[Any, ...] = ((),) if _LOAD_TAKES_INDEX else ()
    return plgpu.load(ref, *index, layout=plgpu.Layout.WGMMA.reduce(along))


def mma_nt(a_smem: Any, b_smem: Any, interpret: bool) -> jax.Array:
    """A B^T [ROWS, rows of B] in float32, both from shared memory (B transposed in place)."""
    if interpret and jax.__version_info__ < (0, 12):
        return lax.dot_general(a_smem[...], b_smem[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def product(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, plgpu.transpose_ref(b_smem, (1, 0)))
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC((ROWS, b_smem.shape[0]), jnp.float32))


def mma_nn(a: jax.Array, b_smem: Any, scratch: Any, interpret: bool, acc: jax.Array | None = None) -> jax.Array:
    """A B [ROWS, columns of B] in float32 with A in registers, added to `acc` in place when given.
    Under the interpreter A goes through `scratch` (shared memory of A's shape), and `acc` is added after
    (the interpreter cannot lower an accumulator initialised from registers)."""
    if interpret:
        scratch[...] = a
        a = scratch

    def multiply(acc_ref):
        plgpu.wgmma(acc_ref, a, b_smem)

    if acc is not None and not interpret:
        return pl.run_state(multiply)(plgpu.ACC.init(acc))

    def product(acc_ref):
        multiply(acc_ref)
        return acc_ref[...]

    out = pl.run_scoped(product, plgpu.ACC((ROWS, b_smem.shape[1]), jnp.float32))
    return out if acc is None else acc + out


def zeros_acc(cols: int, interpret: bool) -> jax.Array:
    """A [ROWS, cols] float32 accumulator of zeros, in wgmma's layout."""
    return in_layout(jnp.zeros((ROWS, cols), jnp.float32), plgpu.Layout.WGMMA, interpret)


def store_rows(x: jax.Array, smem: Any, gmem: Any) -> None:
    """Write a consumer's result rows to global memory through `smem` (TMA) and wait for it."""
    smem[...] = x.astype(smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, gmem)
    plgpu.wait_smem_to_gmem(0)


def ring_scratch(tiles: Sequence[tuple[tuple[int, ...], Any]], stages: int) -> list[Any]:
    """Scratch for a Ring over operands of (shape, dtype) tiles: per operand its `stages` slots, a ready
    barrier per slot (TMA) and a free barrier per slot (every consumer's release). 2-D tiles are laid
    out for wgmma; vectors are plain."""
    smem = lambda shape, dtype: tiled_smem(shape, dtype) if len(shape) == 3 else plgpu.SMEM(shape, dtype)
    slots = [smem((stages, *shape), dtype) for shape, dtype in tiles]
    ready = [plgpu.Barrier(num_arrivals=1, num_barriers=stages) for _ in tiles]
    free = [plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages) for _ in tiles]
    return [*slots, *ready, *free]


@dataclasses.dataclass(frozen=True)
class Ring:
    """Tiles the producer warpgroup streams to the consumers: step i lands in slot i % stages, and a slot
    is refilled once both consumers released it. Consumers take every step in order, releasing the
    ones they do not need, so that each barrier phase is waited for exactly once."""

    slots: tuple[Any, ...]
    ready: tuple[Any, ...]
    free: tuple[Any, ...]
    stages: int

    @classmethod
    def of(cls, refs: Sequence[Any], stages: int) -> Ring:
        """The ring over the refs ring_scratch's scratch became (in its order)."""
        n = len(refs) // 3
        return cls(tuple(refs[:n]), tuple(refs[n : 2 * n]), tuple(refs[2 * n :]), stages)

    def fill(self, sources: Callable[[jax.Array], Sequence[Any]], steps: jax.Array) -> None:
        """The producer: copy `sources(i)` (a global-memory ref per operand) into step i's slot for
        i < steps, then wait for the last slots' releases."""
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        def load(step, carry):
            slot = lax.rem(step, self.stages)
            for src, dst, ready, free in zip(sources(step), self.slots, self.ready, self.free, strict=True):

                @pl.when(step >= self.stages)  # the slot's previous tile released by both consumers
                def _wait(free=free):
                    plgpu.barrier_wait(free.at[slot])

                plgpu.copy_gmem_to_smem(src, dst.at[slot], ready.at[slot])
            return carry

        def drain(step, carry):
            for free in self.free:
                plgpu.barrier_wait(free.at[lax.rem(step, self.stages)])
            return carry

        lax.fori_loop(0, steps, load, None)
        lax.fori_loop(jnp.maximum(steps - self.stages, 0), steps, drain, None)

    def take(self, operand: int, step: jax.Array) -> Any:
        """Wait for step's tile of `operand` and return its slot."""
        slot = lax.rem(step, self.stages)
        plgpu.barrier_wait(self.ready[operand].at[slot])
        return self.slots[operand].at[slot]

    def release(self, operand: int, step: jax.Array) -> None:
        plgpu.barrier_arrive(self.free[operand].at[lax.rem(step, self.stages)])

    def load_vector(self, operand: int, step: jax.Array, along: int, interpret: bool) -> jax.Array:
        """Step's vector of `operand` in registers (load_vector's layout), its slot released. The load is
        a generic-proxy read and the slot's refill a TMA (async-proxy) write: a proxy fence between them
        orders the two (the interpreter's race detector finds the race without it)."""
        x = load_vector(self.take(operand, step), along, interpret)
        plgpu.commit_smem()
        self.release(operand, step)
        return x

    def skip(self, step: jax.Array, carry: Any = None) -> Any:
        """A step this consumer does not need: taken (so that it was loaded) and released."""
        for operand in range(len(self.slots)):
            self.take(operand, step)
            self.release(operand, step)
        return carry


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """What the forward and backward kernels are compiled for."""

    causal: bool
    scale: float
    offset: int  # query i sits at key position i + offset
    group: int  # query heads per K/V head
    block_q: int  # query rows per forward or dQ program (CONSUMERS x ROWS)
    block_k: int  # keys per forward or dQ step
    stages: int  # ring slots
    num_steps: int  # K/V tiles of the whole sequence
    head_dim: int
    dtype: Any
    interpret: bool  # run by Mosaic GPU's CPU interpreter


def visible_steps(q0: jax.Array, cfg: AttentionConfig) -> tuple[jax.Array, jax.Array]:
    """K/V tiles the ROWS queries from q0 can see, and how many of them need no mask."""
    if not cfg.causal:
        return jnp.int32(cfg.num_steps), jnp.int32(cfg.num_steps)
    last = q0 + ROWS + cfg.offset  # one past the last visible key
    steps = jnp.clip(lax.div(last + cfg.block_k - 1, cfg.block_k), 0, cfg.num_steps)
    return steps, jnp.clip(lax.div(q0 + cfg.offset + 1, cfg.block_k), 0, steps)


def causal_mask(
    s: jax.Array, q0: jax.Array, k0: jax.Array, cfg: AttentionConfig, keys_on_rows: bool = False
) -> jax.Array:
    """Scores with -inf where query q0 + i may not see key k0 + j (rows are queries, or keys when
    `keys_on_rows`: the dK/dV kernel's transposed scores)."""
    rows, cols = (iota(s.shape, axis, cfg.interpret) for axis in (0, 1))
    queries, keys = (q0 + cols, k0 + rows) if keys_on_rows else (q0 + rows, k0 + cols)
    return jnp.where(queries + cfg.offset >= keys, s, -jnp.inf)


def walk_kv(
    ring: Ring, q0: jax.Array, program_steps: jax.Array, cfg: AttentionConfig, body: Callable[..., Any], init: Any
) -> Any:
    """A query-side consumer's pass over the K/V ring: `body(step, carry, masked=...)` over the tiles its
    rows see (unmasked ones first), then the tiles only the program's later consumer needs released."""
    steps, full = visible_steps(q0, cfg)
    carry = lax.fori_loop(0, full, functools.partial(body, masked=False), init)
    carry = lax.fori_loop(full, steps, functools.partial(body, masked=True), carry)
    lax.fori_loop(steps, program_steps, ring.skip, None)
    return carry


@dataclasses.dataclass(frozen=True)
class QueryProgram:
    """A query-side program (forward, dQ: 128 query rows of one head): its grid indices and warpgroup,
    its K/V ring, the K/V steps its later consumer sees, and the interpreter's A-operand scratch."""

    tile: jax.Array
    head: jax.Array
    batch: jax.Array
    wg: jax.Array
    ring: Ring
    steps: jax.Array
    a_smem: Any

    def q0(self, cfg: AttentionConfig) -> jax.Array:
        """The first of this consumer's query rows."""
        return self.tile * cfg.block_q + self.wg * ROWS

    def a_scratch(self) -> Any:
        """This consumer's scratch for mma_nn's A operand (only under the interpreter)."""
        return None if self.a_smem is None else self.a_smem.at[self.wg]


def query_scratch(head_dim: int, dtype: Any, cfg: AttentionConfig) -> list[Any]:
    """A query-side program's last scratch: the K/V ring, and under the interpreter a [64, block_k]
    A-operand buffer per consumer."""
    a_smem = [tiled_smem((CONSUMERS, ROWS, cfg.block_k), dtype)] if cfg.interpret else []
    return [*ring_scratch([((cfg.block_k, head_dim), dtype)] * 2, cfg.stages), *a_smem]


def query_program(k_ref: Any, v_ref: Any, scratch: Sequence[Any], cfg: AttentionConfig) -> QueryProgram:
    """Start a query-side program: warpgroup CONSUMERS (the producer) fills the K/V ring from
    `scratch` (query_scratch's) with the tiles of the program's K/V head; the consumers go on."""
    ring = Ring.of(scratch[:6], cfg.stages)
    tile, head, batch, wg = (lax.axis_index(name) for name in ("q", "heads", "batch", "wg"))
    kv_head = lax.div(head, cfg.group)
    steps, _ = visible_steps(tile * cfg.block_q + ROWS, cfg)  # the later consumer's

    def tiles(step: jax.Array) -> tuple[Any, Any]:
        rows = pl.ds(step * cfg.block_k, cfg.block_k)
        return k_ref.at[batch, rows, kv_head], v_ref.at[batch, rows, kv_head]

    @pl.when(wg == CONSUMERS)
    def _producer():
        ring.fill(tiles, steps)

    return QueryProgram(tile, head, batch, wg, ring, steps, scratch[6] if cfg.interpret else None)


def consumers(wg: jax.Array) -> Callable[[Callable[[], None]], None]:
    """Decorator: run the function on the consumer warpgroups, with the registers the producer gave up."""

    def run(fn: Callable[[], None]) -> None:
        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            fn()

    return run


def warp_specialized(body: Callable[..., None], params: Any, **kernel: Any) -> Any:
    """plgpu.kernel with CONSUMERS compute warpgroups and one producer, as axis "wg"; `params`: the
    interpreter's (None compiles)."""
    return plgpu.kernel(body, num_threads=CONSUMERS + 1, thread_name="wg", interpret=params, **kernel)
