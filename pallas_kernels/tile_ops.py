"""Pieces shared by the tiled kernels: float32-accumulating matmul, the online-softmax step (base-2
logits: scores times LOG2E), and the register width of a head."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

LOG2E = math.log2(math.e)  # exp(x) == exp2(x * LOG2E): the kernels' softmax runs in base 2


def dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """2-D matmul with float32 accumulation (full precision for float32 inputs)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def online_softmax_step(
    acc: jax.Array, m: jax.Array, l: jax.Array, s: jax.Array, v: jax.Array, v_scale: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold one tile of base-2 logits `s` [rows, keys] (-inf where masked) and values `v` into the
    running (unnormalised output, row max, row sum). Rows that have seen no key keep m = -inf.
    `v_scale` [keys] (quantized values) scales the probabilities before the dot, not each value."""
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(s - m_safe[:, None])
    corr = jnp.exp2(m - m_safe)
    pv = p if v_scale is None else p * v_scale[None, :]
    return corr[:, None] * acc + dot(pv.astype(v.dtype), v), m_new, corr * l + jnp.sum(p, axis=-1)


def register_head_dim(head_dim: int) -> int:
    """Width of a head in registers: a power of two (Triton tiles) and >= 16 (the MMA's K)."""
    return max(16, pl.next_power_of_2(head_dim))


def head_cols(head_dim: int) -> tuple[jax.Array, jax.Array]:
    """A register tile's columns (register_head_dim of them) and which of them the arrays hold."""
    cols = lax.broadcasted_iota(jnp.int32, (register_head_dim(head_dim),), 0)
    return cols, cols < head_dim
