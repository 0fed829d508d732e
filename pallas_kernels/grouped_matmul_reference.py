"""Grouped (ragged per-expert) matmul reference: rows sorted by group, each group times its own matrix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def grouped_matmul_reference(
    lhs: Float[Array, "M K"], rhs: Float[Array, "G K N"], group_sizes: Int[Array, " G"]
) -> Float[Array, "M N"]:
    """out[r] = lhs[r] @ rhs[g] for the rows r of group g (groups are consecutive runs of rows, sizes
    `group_sizes`); rows past sum(group_sizes) are zero. jax.lax.ragged_dot, float32 accumulation."""
    out = jax.lax.ragged_dot(
        lhs, rhs, group_sizes.astype(jnp.int32), precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    return out.astype(lhs.dtype)
