"""Parameter initialisers of the model's modules: every parameter carries its logical axis names
(sharding's rules map them to the mesh)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def normal_param(
    rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], std: float, dtype: str
) -> nnx.Param:
    """A normally initialised parameter (drawn in float32, stored in `dtype`)."""
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=axes)


def zeros_param(shape: tuple[int, ...], axes: tuple[str | None, ...], dtype: str) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)
