"""Quantization schemes and round-to-nearest: the grid every method (RTN, AWQ, GPTQ, SmoothQuant) rounds onto.

Integer values follow pallas_kernels.quant_matmul_reference: int8 is signed with zero point 0; int4
is an unsigned nibble u in [0, 15] with W = (u - z) * s (z = 8 when symmetric). Symmetric int4 uses
s = amax / 7.5 (the GPTQ / compressed-tensors convention); asymmetric s = (max - min) / 15.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxinfra.quant.qlinear import BITS, GROUP_SIZES, QuantizedLinear
from pallas_kernels.quant_matmul_reference import pack_int4


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """bits 4|8; group_size None = one scale per output channel; act_bits 8 = W8A8 (dynamic per token)."""

    bits: int = 4
    group_size: int | None = 128
    symmetric: bool = True
    act_bits: int | None = None

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits}")
        if self.group_size is not None and self.group_size not in GROUP_SIZES:
            why = f"must be one of {GROUP_SIZES} or 0 / None (per channel)"
            raise ValueError(f"group_size {why}, got {self.group_size}")
        if self.bits == 8 and not self.symmetric:
            raise ValueError("int8 weights are symmetric here (symmetric=False needs bits=4)")
        if self.act_bits not in (None, 8):
            raise ValueError(f"act_bits must be None or 8, got {self.act_bits}")
        if self.act_bits == 8 and (self.bits != 8 or self.group_size is not None):
            raise ValueError("W8A8 needs bits=8 and per-channel weights (group_size None)")

    @property
    def qmax(self) -> int:
        return 127 if self.bits == 8 else 15

    def check_width(self, k: int, name: str) -> None:
        """A ValueError naming the layer when its input width K does not fit the groups."""
        if self.group_size is not None and k % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide the input width {k} of {name}")
        if self.bits == 4 and self.group_size is None and k % 32:
            raise ValueError(f"per-channel int4 needs an input width divisible by 32; {name} has {k}")

    def num_groups(self, k: int) -> int:
        return 1 if self.group_size is None else k // self.group_size


def params(w: Float[Array, "G N"], scheme: QuantScheme, ratio: jax.Array | float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Scale and zero point [N] (float32) for rows w of one group, its range shrunk by `ratio` (AWQ's
    clipping). Zero points are 0 (int8) or 8 (int4 sym)."""
    w = w.astype(jnp.float32)
    if scheme.symmetric:
        amax = jnp.max(jnp.abs(w), axis=0) * ratio
        scale = amax / (127.0 if scheme.bits == 8 else 7.5)
        zero = jnp.full_like(scale, 0.0 if scheme.bits == 8 else 8.0)
    else:
        lo = jnp.minimum(jnp.min(w, axis=0), 0.0) * ratio
        hi = jnp.maximum(jnp.max(w, axis=0), 0.0) * ratio
        scale = (hi - lo) / scheme.qmax
        zero = jnp.clip(jnp.round(-lo / jnp.where(scale == 0, 1.0, scale)), 0, scheme.qmax)
    return jnp.where(scale == 0, 1.0, scale), zero


def round_to_grid(w: jax.Array, scale: jax.Array, zero: jax.Array, scheme: QuantScheme) -> jax.Array:
    """Integer values (as float32) of w on the grid (scale, zero): int8 in [-127, 127], int4 in [0, 15]."""
    lo, hi = (-127, 127) if scheme.bits == 8 else (0, 15)
    return jnp.clip(jnp.round(w.astype(jnp.float32) / scale) + zero, lo, hi)


def dequant(q: jax.Array, scale: jax.Array, zero: jax.Array) -> jax.Array:
    return (q - zero) * scale


def rtn(
    w: Float[Array, "K N"], scheme: QuantScheme, ratio: Float[Array, "G N"] | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Round-to-nearest: integer values [K, N] (float32), scales and zero points [G, N]; `ratio`
    shrinks each group's range (clipping outliers)."""
    k, n = w.shape
    g = k // scheme.num_groups(k)
    groups = w.reshape(k // g, g, n)
    ratio = jnp.ones((k // g, n), jnp.float32) if ratio is None else ratio
    scale, zero = jax.vmap(lambda x, r: params(x, scheme, r))(groups, ratio)
    q = round_to_grid(groups, scale[:, None], zero[:, None], scheme)
    return q.reshape(k, n), scale, zero


def fake_quant(
    w: Float[Array, "K N"], scheme: QuantScheme, ratio: Float[Array, "G N"] | None = None
) -> Float[Array, "K N"]:
    """w rounded onto its RTN grid and back (what the quantized layer computes with)."""
    q, scale, zero = rtn(w, scheme, ratio)
    k = w.shape[0]
    g = k // scale.shape[0]
    return dequant(q.reshape(-1, g, w.shape[1]), scale[:, None], zero[:, None]).reshape(w.shape)


def storage_group(k: int, scheme: QuantScheme) -> int:
    """Rows per stored scale: the scheme's group, or for per-channel int4 the largest kernel group dividing K."""
    if scheme.group_size is not None:
        return scheme.group_size
    if scheme.bits == 8:
        return k
    return next(g for g in reversed(GROUP_SIZES) if k % g == 0)


def to_linear(
    q: Float[Array, "K N"],
    scale: Float[Array, "G N"],
    zero: Float[Array, "G N"],
    scheme: QuantScheme,
    *,
    in_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    dtype: jnp.dtype,
    perm: jax.Array | None = None,
    axes: tuple[str | None, str | None] = (None, None),
) -> QuantizedLinear:
    """Pack integer values, scales and zero points into a QuantizedLinear (scales in `dtype`)."""
    k = q.shape[0]
    g = storage_group(k, scheme)
    reps = (k // g) // scale.shape[0]  # per-channel int4 is stored with its scale repeated per group
    scale, zero = jnp.repeat(scale, reps, axis=0), jnp.repeat(zero, reps, axis=0)
    if scheme.bits == 8:
        qweight = q.astype(jnp.int8)
    else:
        qweight = pack_int4(q.astype(jnp.uint8), g)
    zeros = None if scheme.symmetric else zero.astype(jnp.uint8)
    return QuantizedLinear(
        qweight,
        scale.astype(dtype),
        zeros,
        bits=scheme.bits,
        in_shape=in_shape,
        out_shape=out_shape,
        act_bits=scheme.act_bits,
        perm=perm,
        axes=axes,
    )
