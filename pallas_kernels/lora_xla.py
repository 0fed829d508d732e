"""Multi-LoRA in XLA: the path that runs off GPU, and the gradients of the adapter pools.

Few tokens (decode: T <= slots) gather each token's A and B and contract them; more tokens multiply
by every slot at once (x @ [in, S*R], the [T, S*R] product masked to each token's slot and scaled,
then @ [S*R, out]): two dense matmuls that cost S*R / out of the base projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from pallas_kernels.lora_reference import check_pools, check_slots


def _precision(dtype: jnp.dtype) -> lax.Precision | None:
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def lora_delta_xla(
    x: Float[Array, "T IN"],
    slots: Int[Array, " T"],
    a: Float[Array, "S IN R"],
    b: Float[Array, "S R OUT"],
    scaling: Float[Array, " S"],
) -> Float[Array, "T OUT"]:
    """scaling[s] * (x[t] @ A[s]) @ B[s] per token (zero for slot -1), in x's dtype; differentiable
    in x, A, B and scaling."""
    check_pools(x, a, b, scaling)
    check_slots(x, slots)
    (t, n_in), (s, _, r) = x.shape, a.shape
    prec, f32 = _precision(x.dtype), jnp.float32
    on = slots >= 0
    if t <= s:
        idx = jnp.where(on, slots, 0)
        w = jnp.where(on, scaling[idx].astype(f32), 0.0)
        v = jnp.einsum("ti,tir->tr", x, a[idx].astype(x.dtype), precision=prec, preferred_element_type=f32)
        v = (v * w[:, None]).astype(x.dtype)
        y = jnp.einsum("tr,tro->to", v, b[idx].astype(x.dtype), precision=prec, preferred_element_type=f32)
        return y.astype(x.dtype)
    a_all = jnp.swapaxes(a, 0, 1).reshape(n_in, s * r).astype(x.dtype)
    v = jnp.dot(x, a_all, precision=prec, preferred_element_type=f32).reshape(t, s, r)
    w = (slots[:, None] == jnp.arange(s)[None, :]) * scaling[None, :].astype(f32)
    v = (v * w[:, :, None]).reshape(t, s * r).astype(x.dtype)
    y = jnp.dot(v, b.reshape(s * r, -1).astype(x.dtype), precision=prec, preferred_element_type=f32)
    return y.astype(x.dtype)


def pool_grads(
    x: jax.Array, slots: jax.Array, a: jax.Array, b: jax.Array, scaling: jax.Array, dy: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The cotangents of A, B and scaling for output cotangent dy (the kernels' backward uses these;
    the input gradient runs through the kernel itself)."""
    _, vjp = jax.vjp(lambda a, b, sc: lora_delta_xla(x, slots, a, b, sc), a, b, scaling)
    return vjp(dy.astype(x.dtype))
