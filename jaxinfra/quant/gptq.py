"""GPTQ (Frantar et al. 2022): quantize a weight one input row at a time, spreading each row's
rounding error over the rows not yet quantized through the inverse Hessian of the layer's inputs.

H = 2 X^T X / n from calibration activations, damped by `damp` x mean(diag H); its inverse's upper
Cholesky factor drives the updates, applied lazily in blocks of one quantization group (128 rows
for per-channel scales). With act-order, rows are processed by decreasing diag(H) with each group's
scale and zero point fixed beforehand from the weights in their original order ("static groups",
compressed-tensors' actorder="weight"), so the result needs no g_idx and no runtime permutation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxinfra.quant.rtn import QuantScheme, dequant, params, round_to_grid

PER_CHANNEL_BLOCK = 128


def hessian(x: jax.Array) -> jax.Array:
    """2 X^T X / n for inputs x [n, K] (float32)."""
    x = x.astype(jnp.float32)
    return 2.0 * (x.T @ x) / x.shape[0]


@functools.partial(jax.jit, static_argnames=("scheme", "act_order"))
def gptq(
    w: jax.Array, h: jax.Array, scheme: QuantScheme, *, damp: float = 0.01, act_order: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantize w [K, N] given H [K, K]: (integer values [K, N], scales [G, N], zeros [G, N])."""
    k, n = w.shape
    w = w.astype(jnp.float32)
    dead = jnp.diagonal(h) == 0
    h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
    w = jnp.where(dead[:, None], 0.0, w)
    groups = scheme.num_groups(k)
    g = k // groups
    fixed_scales, fixed_zeros = jax.vmap(lambda x: params(x, scheme))(w.reshape(groups, g, n))
    perm = jnp.argsort(-jnp.diagonal(h)) if act_order else jnp.arange(k)
    w, h = w[perm], h[perm][:, perm]
    h = h + damp * jnp.mean(jnp.diagonal(h)) * jnp.eye(k)
    hinv = jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(h), True), jnp.eye(k))
    u = jnp.linalg.cholesky(hinv).T  # upper: Hinv = U^T U
    fixed = act_order or scheme.group_size is None  # params known up front (else: at each group's start)
    block = min(PER_CHANNEL_BLOCK, k) if scheme.group_size is None else scheme.group_size
    if k % block:
        raise ValueError(f"GPTQ needs the input width {k} divisible by {block}")

    def block_step(b: jax.Array, carry: tuple) -> tuple:
        w, q, scales, zeros = carry
        i1 = b * block
        w1 = lax.dynamic_slice(w, (i1, 0), (block, n))
        u1 = lax.dynamic_slice(u, (i1, i1), (block, block))
        if not fixed:
            scale, zero = params(w1, scheme)
            scales, zeros = scales.at[b].set(scale), zeros.at[b].set(zero)

        def column(i: jax.Array, c: tuple) -> tuple:
            w1, q1, e1 = c
            row = w1[i]
            grp = perm[i1 + i] // g
            qi = round_to_grid(row, scales[grp], zeros[grp], scheme)
            err = (row - dequant(qi, scales[grp], zeros[grp])) / u1[i, i]
            w1 = w1 - u1[i][:, None] * err[None, :]  # U is upper: rows before i are untouched
            return w1, q1.at[i].set(qi), e1.at[i].set(err)

        zeros_b = jnp.zeros((block, n), jnp.float32)
        _, q1, e1 = lax.fori_loop(0, block, column, (w1, zeros_b, zeros_b))
        w = w - lax.dynamic_slice(u, (i1, 0), (block, k)).T @ e1  # lazy update of the later rows
        return w, lax.dynamic_update_slice(q, q1, (i1, 0)), scales, zeros

    init = (w, jnp.zeros((k, n), jnp.float32), fixed_scales, fixed_zeros)
    _, q, scales, zeros = lax.fori_loop(0, k // block, block_step, init)
    return q[jnp.argsort(perm)], scales, zeros
