"""AWQ (Lin et al. 2023): activation-aware per-input-channel scales, then clipped round-to-nearest.

For the linears that share an input X, scales s = mean|X|^a / mean|W_norm|^(1-a) are searched over a
grid of a by the output error of X @ Q(W * s) / s; W's rows are multiplied by s and the producer of
X (an RMSNorm, or the previous linear's output channels) divided by it, so the float model is
unchanged and salient channels get finer quantization. Then each weight's per-group range is shrunk
by the ratio (1.0 down to 0.5) that minimises its output error (skipped for q/k, as AutoAWQ does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxinfra.models.layers import DecoderLayer
from jaxinfra.quant import decoder_linears as lin
from jaxinfra.quant.rtn import QuantScheme, fake_quant

MAX_TOKENS = 4096  # calibration tokens used by the searches


def _tokens(x: jax.Array) -> jax.Array:
    return x if x.shape[0] <= MAX_TOKENS else x[:: x.shape[0] // MAX_TOKENS][:MAX_TOKENS]


@functools.partial(jax.jit, static_argnames=("scheme", "grid"))
def search_scales(x: jax.Array, w: jax.Array, scheme: QuantScheme, grid: int = 20) -> jax.Array:
    """Per-input-channel scales [K] for inputs x [n, K] and the concatenated weights w [K, N]."""
    k, n = w.shape
    g = k // scheme.num_groups(k)
    wa = jnp.abs(w).reshape(k // g, g, n)
    w_mean = (wa / jnp.maximum(jnp.max(wa, axis=1, keepdims=True), 1e-12)).reshape(k, n).mean(axis=1)
    x_mean = jnp.abs(x).mean(axis=0)
    y = x @ w

    def scales(alpha: jax.Array) -> jax.Array:
        s = jnp.maximum(x_mean**alpha / (w_mean ** (1 - alpha) + 1e-4), 1e-4)
        return s / jnp.sqrt(jnp.max(s) * jnp.min(s))

    def loss(alpha: jax.Array) -> jax.Array:
        s = scales(alpha)
        wq = fake_quant(w * s[:, None], scheme) / s[:, None]
        return jnp.mean((x @ wq - y) ** 2)

    alphas = jnp.arange(grid, dtype=jnp.float32) / grid
    return scales(alphas[jnp.argmin(lax.map(loss, alphas))])


@functools.partial(jax.jit, static_argnames=("scheme", "steps"))
def search_clip(x: jax.Array, w: jax.Array, scheme: QuantScheme, steps: int = 10) -> jax.Array:
    """Per-(group, output channel) range ratios [G, N] in [0.5, 1] minimising |x (w - Q(w))|^2."""
    k, n = w.shape
    g = k // scheme.num_groups(k)
    xg = x.reshape(x.shape[0], k // g, g)
    cov = jnp.einsum("tgi,tgj->gij", xg, xg)

    def err(ratio: jax.Array) -> jax.Array:
        r = jnp.full((k // g, n), ratio)
        d = (w - fake_quant(w, scheme, r)).reshape(k // g, g, n)
        return jnp.einsum("gin,gij,gjn->gn", d, cov, d)

    ratios = 1.0 - 0.5 * jnp.arange(steps + 1, dtype=jnp.float32) / steps
    errors = lax.map(err, ratios)  # [R, G, N]
    return ratios[jnp.argmin(errors, axis=0)]


def _foldable(layer: DecoderLayer, group: lin.InputGroup) -> bool:
    """o_proj's input channels map one to one onto v_proj's outputs only without GQA."""
    cfg = layer.attn.cfg
    return group.name != "o_in" or cfg.num_heads == cfg.num_kv_heads


def awq_layer(layer: DecoderLayer, capture, scheme: QuantScheme) -> dict[str, jax.Array]:
    """Search and fold the scales of every input group, then the clip ratios; returns them per linear.

    One capture serves every scale search: folding a group's scales leaves the other groups' inputs
    unchanged (the float layer computes the same function)."""
    inputs = capture()
    for group in lin.GROUPS:
        if _foldable(layer, group):
            w = jnp.concatenate([lin.matrix(layer, name) for name in group.linears], axis=1)
            lin.fold_scales(layer, group, search_scales(_tokens(inputs[group.name]), w, scheme))
    inputs = capture()
    return {
        name: search_clip(_tokens(inputs[group.name]), lin.matrix(layer, name), scheme)
        for group in lin.GROUPS
        for name in group.linears
        if name not in ("attn.q_proj", "attn.k_proj")
    }
