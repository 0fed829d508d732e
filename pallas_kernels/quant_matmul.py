"""Quantized matmuls in Pallas (Triton lowering), beside quant_matmul_reference.py.

W8A16 / W4A16: each program owns a [block_m, block_n] output tile and one of `num_splits` ranges of
K (split-K: a decode-sized M still spreads over every SM). It walks its range one step at a time,
loading int8 or packed-int4 weights and converting the integers (minus the zero point) to the
activation dtype, which is exact; each step's partial dot product is then scaled by its group's
scales, [block_m, block_n] multiplies instead of one per weight. W8A8: int8 x int8 -> int32 with
per-token and per-channel scales in the epilogue. Rows past M are masked (M=1 needs no padding);
with split-K the float32 partials are summed by one small XLA reduction. The public functions
dispatch: past DEQUANT_DOT_MIN_M rows, dequantize once and use XLA's dense matmul.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels.quant_matmul_reference import (
    SYMMETRIC_ZERO,
    dequantize_weight,
    group_size,
    int8_matmul_reference,
    weight_rows,
)
from pallas_kernels.tile_ops import dot

SM_COUNT = 132  # H100 / H200 SXM streaming multiprocessors: the programs split-K aims to fill
MAX_SPLITS = 16
MIN_STEPS_PER_SPLIT = 2  # K steps each split walks at least (a split's start-up is not free)
# Grouped weights step one group per iteration up to this many rows, larger groups block_k rows at a
# time (each step scaled by its group): at sm_90a a 128-row int4 step holds 212 registers per thread
# (M=1, 128 columns, 4 warps), a 64-row one 120 (benchmarks/kernel_report.py).
MAX_GROUP_STEP = 64
# Rows from which the dispatchers dequantize the weight once and call XLA's bf16 matmul instead of
# the kernel. A guess from the H200 sweep in #47 (the kernels lost even at M=64 before split-K);
# it awaits a GPU measurement of the split-K kernels (benchmarks/quant_matmul.py).
DEQUANT_DOT_MIN_M = 128


@dataclasses.dataclass(frozen=True)
class MatmulTiles:
    """Output tile, K step (per-channel scales; grouped weights step one group) and split-K count."""

    block_m: int
    block_n: int
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int = 1


def default_splits(programs: int, steps: int) -> int:
    """The largest divisor of `steps` (K steps) that keeps `programs` output tiles x splits within
    one wave of SM_COUNT programs, leaving each split at least MIN_STEPS_PER_SPLIT steps."""
    wanted = max(1, min(MAX_SPLITS, SM_COUNT // programs, steps // MIN_STEPS_PER_SPLIT))
    return max(d for d in range(1, wanted + 1) if steps % d == 0)


def default_tiles(m: int, n: int, k: int, step: int | None = None, int4: bool = False) -> MatmulTiles:
    """Decode (M <= 16): 16-row tiles (the MMA's least), wide columns, split-K; prefill: 32- to 128-row
    tiles. `step` is the kernel's K step (a group for grouped weights; default block_k). Unpacking
    int4 doubles the tile's registers: 8 warps from 32 x 128 (at 64 x 128 and 4 warps ptxas needs 255)."""
    if n % 16 or k % 16:
        raise ValueError(f"the Pallas quantized matmul needs N and K multiples of 16, got N={n}, K={k}")
    block_m = next(b for b in (16, 32, 64, 128) if m <= b or b == 128)
    block_n = next(b for b in (128, 64, 32, 16) if n % b == 0)
    block_k = next(b for b in (64, 32, 16) if k % b == 0)
    splits = default_splits(pl.cdiv(m, block_m) * (n // block_n), k // (step or block_k))
    warps = 4 if block_m * block_n * (2 if int4 else 1) <= 64 * 128 else 8
    return MatmulTiles(block_m, block_n, block_k, num_warps=warps, num_splits=splits)


def _check(n: int, k: int, step: int, tiles: MatmulTiles) -> None:
    if n % tiles.block_n:
        raise ValueError(f"N={n} is not a multiple of the tile's {tiles.block_n}")
    if k % step or (k // step) % tiles.num_splits:
        raise ValueError(f"K={k} is not a multiple of {tiles.num_splits} splits of {step}-row steps")


def _rows(m: int, block_m: int) -> tuple[jax.Array, jax.Array]:
    """This program's rows, those past M pointing at row M (masked, they touch nothing), and which
    of them are real."""
    r = pl.program_id(0) * block_m + lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    return jnp.minimum(r, m), r < m


def _load_x(x_ref, rows, valid, col0, width: int) -> jax.Array:
    """Activations [block_m, width] from column col0, zeros in the rows past M."""
    cols = col0 + lax.broadcasted_iota(jnp.int32, (width,), 0)
    return plgpu.load(x_ref.at[rows[:, None], cols[None, :]], mask=valid[:, None], other=0)


def _store(o_ref, rows, valid, acc: jax.Array) -> None:
    """Write this program's [block_m, block_n] tile (rows past M masked) in o_ref's dtype."""
    cols = pl.program_id(1) * acc.shape[1] + lax.broadcasted_iota(jnp.int32, (acc.shape[1],), 0)
    plgpu.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype), mask=valid[:, None])


def _weight_only_kernel(
    x_ref, q_ref, s_ref, z_ref, o_ref, *, bits: int, group: int, step: int, block_m: int, symmetric: bool
):
    """One [block_m, block_n] tile over one K split: a dot per step, scaled by the step's group."""
    m, per_channel = x_ref.shape[0], s_ref.shape[0] == 1
    rows, valid = _rows(m, block_m)
    packed = step // 2 if bits == 4 else step  # weight rows one step loads
    split_rows = q_ref.shape[0]  # this split's weight rows
    base = pl.program_id(2) * split_rows

    def body(t, acc):
        p = base + t * packed  # first global weight row of the step
        gi = p // (group // 2 if bits == 4 else group)
        z = SYMMETRIC_ZERO[bits] if symmetric else z_ref[pl.ds(gi, 1), :].astype(jnp.int32)
        u = q_ref[pl.ds(t * packed, packed), :].astype(jnp.int32)
        if bits == 8:
            part = dot(_load_x(x_ref, rows, valid, p, step), (u - z).astype(x_ref.dtype))
        else:  # packed row p holds K rows lo and lo + group / 2 (quant_matmul_reference's layout)
            lo = p + gi * (group // 2)
            part = dot(_load_x(x_ref, rows, valid, lo, packed), ((u & 0xF) - z).astype(x_ref.dtype))
            part += dot(_load_x(x_ref, rows, valid, lo + group // 2, packed), ((u >> 4) - z).astype(x_ref.dtype))
        return acc + (part if per_channel else part * s_ref[pl.ds(gi, 1), :].astype(jnp.float32))

    acc = lax.fori_loop(0, split_rows // packed, body, jnp.zeros((block_m, q_ref.shape[1]), jnp.float32))
    if per_channel:
        acc = acc * s_ref[...].astype(jnp.float32)
    _store(o_ref, rows, valid, acc)


def _split_call(
    kernel,
    m: int,
    n: int,
    tiles: MatmulTiles,
    dtype,
    name: str,
    in_specs,
    args,
    interpret: bool | None,
    partial_dtype: jnp.dtype = jnp.float32,
) -> jax.Array:
    """Run `kernel` on grid (M tiles, N tiles, splits); with several splits, return their partials
    ([splits, M, N] in `partial_dtype`) summed."""
    splits = tiles.num_splits
    if splits == 1:
        out_spec = pl.BlockSpec((m, n), lambda i, j, c: (0, 0))
        out_shape = jax.ShapeDtypeStruct((m, n), dtype)
    else:
        out_spec = pl.BlockSpec((pl.squeezed, m, n), lambda i, j, c: (c, 0, 0))
        out_shape = jax.ShapeDtypeStruct((splits, m, n), partial_dtype)
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, tiles.block_m), n // tiles.block_n, splits),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        name=name,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
    )(*args)
    return out if splits == 1 else jnp.sum(out, axis=0)


def weight_only_matmul_pallas(
    x: Float[Array, "M K"],
    qweight: Shaped[Array, "KP N"],
    scales: Float[Array, "G N"],
    zeros: Shaped[Array, "G N"] | None,
    *,
    bits: int,
    tiles: MatmulTiles | None = None,
    interpret: bool | None = None,
) -> Float[Array, "M N"]:
    """x @ dequantize(W) for int8 or packed int4 W (layout in quant_matmul_reference), output in x's
    dtype: the Pallas kernel at any M."""
    if bits not in SYMMETRIC_ZERO:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    m, k = x.shape
    n = qweight.shape[1]
    if weight_rows(qweight, bits) != k:
        raise ValueError(f"x has K={k} but the {bits}-bit weight covers {weight_rows(qweight, bits)} rows")
    group = group_size(k, scales)
    grouped = scales.shape[0] > 1
    block_k = tiles.block_k if tiles else next(b for b in (64, 32, 16) if k % b == 0)
    step = group if grouped and group <= MAX_GROUP_STEP else block_k
    if (step % 32 and bits == 4) or step % 16 or (grouped and group % step):
        raise ValueError(f"group size {group} does not fit the kernel (int4 needs >= 32, int8 >= 16)")
    tiles = tiles or default_tiles(m, n, k, step, int4=bits == 4)
    _check(n, k, step, tiles)
    bn, sk = tiles.block_n, qweight.shape[0] // tiles.num_splits
    z = jnp.zeros((1, n), jnp.uint8) if zeros is None else zeros
    kernel = functools.partial(
        _weight_only_kernel, bits=bits, group=group, step=step, block_m=tiles.block_m, symmetric=zeros is None
    )
    in_specs = [
        pl.BlockSpec((m, k), lambda i, j, c: (0, 0)),
        pl.BlockSpec((sk, bn), lambda i, j, c: (c, j)),
        pl.BlockSpec((scales.shape[0], bn), lambda i, j, c: (0, j)),
        pl.BlockSpec((z.shape[0], bn), lambda i, j, c: (0, j)),
    ]
    name = f"jaxinfra_w{bits}a16_matmul"
    return _split_call(kernel, m, n, tiles, x.dtype, name, in_specs, (x, qweight, scales, z), interpret).astype(x.dtype)


def weight_only_matmul(
    x: Float[Array, "M K"],
    qweight: Shaped[Array, "KP N"],
    scales: Float[Array, "G N"],
    zeros: Shaped[Array, "G N"] | None,
    *,
    bits: int,
    tiles: MatmulTiles | None = None,
    interpret: bool | None = None,
) -> Float[Array, "M N"]:
    """x @ dequantize(W): the kernel below DEQUANT_DOT_MIN_M rows (or with explicit tiles), else the
    weight dequantized once to x's dtype and XLA's dense matmul."""
    if tiles is not None or x.shape[0] < DEQUANT_DOT_MIN_M:
        return weight_only_matmul_pallas(x, qweight, scales, zeros, bits=bits, tiles=tiles, interpret=interpret)
    w = dequantize_weight(qweight, scales, zeros, bits=bits, dtype=x.dtype)
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32).astype(x.dtype)


def _int8_kernel(x_ref, xs_ref, w_ref, ws_ref, o_ref, *, step: int, block_m: int):
    """int32 dot of one tile over one K split; per-token and per-channel scales in the epilogue (with
    split-K the int32 partials are stored unscaled: their sum stays exact)."""
    m = x_ref.shape[0]
    rows, valid = _rows(m, block_m)
    base = pl.program_id(2) * w_ref.shape[0]

    def body(t, acc):
        a = _load_x(x_ref, rows, valid, base + t * step, step)
        b = w_ref[pl.ds(t * step, step), :]
        return acc + lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)

    acc = lax.fori_loop(0, w_ref.shape[0] // step, body, jnp.zeros((block_m, w_ref.shape[1]), jnp.int32))
    if o_ref.dtype == jnp.int32:
        _store(o_ref, rows, valid, acc)
        return
    xs = plgpu.load(xs_ref.at[rows], mask=valid, other=0.0)
    _store(o_ref, rows, valid, acc.astype(jnp.float32) * xs[:, None] * ws_ref[...].astype(jnp.float32))


def int8_matmul_pallas(
    xq: Int[Array, "M K"],
    x_scale: Float[Array, " M"],
    wq: Int[Array, "K N"],
    w_scale: Float[Array, " N"],
    *,
    out_dtype: jnp.dtype,
    tiles: MatmulTiles | None = None,
    interpret: bool | None = None,
) -> Float[Array, "M N"]:
    """W8A8: (xq @ wq in int32) * x_scale[:, None] * w_scale[None, :], in `out_dtype`: the kernel."""
    m, k = xq.shape
    n = wq.shape[1]
    if wq.shape[0] != k:
        raise ValueError(f"xq has K={k} but wq has {wq.shape[0]} rows")
    tiles = tiles or default_tiles(m, n, k)
    _check(n, k, tiles.block_k, tiles)
    bn, sk = tiles.block_n, k // tiles.num_splits
    kernel = functools.partial(_int8_kernel, step=tiles.block_k, block_m=tiles.block_m)
    in_specs = [
        pl.BlockSpec((m, k), lambda i, j, c: (0, 0)),
        pl.BlockSpec((m,), lambda i, j, c: (0,)),
        pl.BlockSpec((sk, bn), lambda i, j, c: (c, j)),
        pl.BlockSpec((1, bn), lambda i, j, c: (0, j)),
    ]
    xs, ws = x_scale.astype(jnp.float32), w_scale.reshape(1, n)
    out = _split_call(
        kernel, m, n, tiles, out_dtype, "jaxinfra_w8a8_matmul", in_specs, (xq, xs, wq, ws), interpret, jnp.int32
    )
    if tiles.num_splits == 1:
        return out
    return (out.astype(jnp.float32) * xs[:, None] * ws.astype(jnp.float32)).astype(out_dtype)


def int8_matmul(
    xq: Int[Array, "M K"],
    x_scale: Float[Array, " M"],
    wq: Int[Array, "K N"],
    w_scale: Float[Array, " N"],
    *,
    out_dtype: jnp.dtype,
    tiles: MatmulTiles | None = None,
    interpret: bool | None = None,
) -> Float[Array, "M N"]:
    """W8A8: the kernel below DEQUANT_DOT_MIN_M rows (or with explicit tiles), else XLA's int8 matmul."""
    if tiles is not None or xq.shape[0] < DEQUANT_DOT_MIN_M:
        return int8_matmul_pallas(xq, x_scale, wq, w_scale, out_dtype=out_dtype, tiles=tiles, interpret=interpret)
    return int8_matmul_reference(xq, x_scale, wq, w_scale, out_dtype=out_dtype)
