"""SmoothQuant (Xiao et al. 2022): move activation outliers into the weights, then W8A8.

For linears fed by an RMSNorm, s = max|X|^alpha / max|W|^(1 - alpha) per input channel; the norm's
scale is divided by s and the weights' rows multiplied by it. Every linear then gets per-channel
int8 weights and per-token dynamic int8 activations, multiplied int8 x int8 -> int32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfra.models.layers import DecoderLayer
from jaxinfra.quant import decoder_linears as lin


def smoothing_scales(act_max: jax.Array, w: jax.Array, alpha: float) -> jax.Array:
    """s [K] from per-channel activation maxima [K] and the group's weights [K, N]."""
    w_max = jnp.max(jnp.abs(w), axis=1)
    s = jnp.maximum(act_max, 1e-5) ** alpha / jnp.maximum(w_max, 1e-5) ** (1 - alpha)
    return jnp.clip(s, 1e-5, 1e5)


def smooth_layer(layer: DecoderLayer, capture, alpha: float) -> None:
    """Fold smoothing scales into the two norms of a decoder layer (attention input, MLP input)."""
    inputs = capture()
    for group in lin.GROUPS:
        if group.norm is None:
            continue
        act_max = jnp.max(jnp.abs(inputs[group.name]), axis=0)
        w = jnp.concatenate([lin.matrix(layer, name) for name in group.linears], axis=1)
        lin.fold_scales(layer, group, smoothing_scales(act_max, w, alpha))
