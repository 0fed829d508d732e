"""Float32 master weights used directly by lower-precision activations (training with
`grad_reduce_dtype: float32`): each op casts the weight at use, and the weight's gradient leaves its
matmul or reduction in float32, so data-parallel partial gradients are summed across devices in
float32 instead of being rounded to the compute dtype first. With equal dtypes every op here is the
plain one (serving, float32 training)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from sharding import constrain

Names = tuple[str | None, ...] | None


def weight_einsum(
    spec: str,
    x: Float[Array, "*xs"],
    w: Float[Array, "*ws"],
    out_dtype: jnp.dtype | None = None,
    names: Names = None,
) -> jax.Array:
    """`jnp.einsum(spec, x, w)` in x's dtype (output `out_dtype` if given); a float32 `w` under
    lower-precision `x` gets its gradient from a matmul with float32 output. `names`: logical axes
    of the weight, constrained (where the rules map them) after the cast, so an FSDP gather of it
    happens in the compute dtype."""
    if w.dtype == x.dtype:
        return jnp.einsum(spec, x, _constrain(w, names), preferred_element_type=out_dtype)
    return _mixed_einsum(spec, out_dtype, names, x, w)


def _constrain(w: jax.Array, names: Names) -> jax.Array:
    return w if names is None else constrain(w, names, unmapped_free=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _mixed_einsum(spec: str, out_dtype: jnp.dtype | None, names: Names, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, _constrain(w.astype(x.dtype), names), preferred_element_type=out_dtype)


def _mixed_fwd(
    spec: str, out_dtype: jnp.dtype | None, names: Names, x: jax.Array, w: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    wc = _constrain(w.astype(x.dtype), names)
    return jnp.einsum(spec, x, wc, preferred_element_type=out_dtype), (x, wc)


def _mixed_bwd(
    spec: str, out_dtype: jnp.dtype | None, names: Names, residuals: tuple[jax.Array, jax.Array], g: jax.Array
) -> tuple[jax.Array, jax.Array]:
    x, wc = residuals
    _, input_vjp = jax.vjp(lambda x: jnp.einsum(spec, x, wc, preferred_element_type=out_dtype), x)
    (dx,) = input_vjp(g)
    x_axes, rest = spec.split(",")
    w_axes, out_axes = rest.split("->")
    dw = jnp.einsum(f"{x_axes},{out_axes}->{w_axes}", x, g, preferred_element_type=jnp.float32)
    return dx, dw


_mixed_einsum.defvjp(_mixed_fwd, _mixed_bwd)


def scale(x: jax.Array, s: jax.Array) -> jax.Array:
    """x * s (a norm's scale) in x's dtype; a float32 `s` multiplies in float32, so its gradient is
    summed over tokens in float32."""
    if s.dtype == x.dtype:
        return x * s
    return (x.astype(jnp.float32) * s.astype(jnp.float32)).astype(x.dtype)


def add_bias(x: jax.Array, b: jax.Array) -> jax.Array:
    """x + b in x's dtype; a float32 bias is added in float32 (its gradient summed in float32)."""
    if b.dtype == x.dtype:
        return x + b
    return (x.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)
