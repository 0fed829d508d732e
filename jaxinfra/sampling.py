"""Token sampling from logits: greedy, temperature, top-k, top-p (nucleus) and min-p.

The filters take a value per row (or one for all rows); the serving sampler (serve/core/sampler.py) and
the reference generator both use them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

PerRow = Float[Array, " B"] | float
PerRowInt = Int[Array, " B"] | int


ARGMAX_CHUNK = 128  # vocabulary entries per chunk of the two-pass argmax


def argmax(x: Float[Array, "*B V"]) -> Int[Array, " *B"]:
    """`jnp.argmax(x, axis=-1)` as int32 in two passes: the largest of each chunk of ARGMAX_CHUNK entries,
    then the first chunk holding the largest and the first largest within it. Same index (the first of
    ties, a NaN the largest), except that a +inf, or finite values whose sum overflows both ways, in a
    chunk before the first NaN's wins. XLA's CPU argmax is a scalar (value, index) reduction, 2-10x
    slower on [16-128, 4k-152k] logits; a max over chunks vectorizes."""
    v = x.shape[-1]
    if v <= ARGMAX_CHUNK:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    pad = [(0, 0)] * (x.ndim - 1) + [(0, -v % ARGMAX_CHUNK)]
    chunks = jnp.pad(x, pad, constant_values=-jnp.inf).reshape(*x.shape[:-1], -1, ARGMAX_CHUNK)
    # a chunk holding a NaN ranks as +inf (XLA's vectorized max on CPU may drop a NaN; a sum keeps it)
    top = jnp.where(jnp.isnan(jnp.sum(chunks, axis=-1)), jnp.inf, jnp.max(chunks, axis=-1))
    best = jnp.argmax(top, axis=-1)
    within = jnp.argmax(jnp.take_along_axis(chunks, best[..., None, None], axis=-2)[..., 0, :], axis=-1)
    return (best * ARGMAX_CHUNK + within).astype(jnp.int32)


def _col(x: PerRow | PerRowInt) -> jax.Array:
    x = jnp.asarray(x)
    return x[:, None] if x.ndim else x


def top_p_min_p_cutoff(
    sorted_desc: Float[Array, "B K"], top_p: PerRow, min_p: PerRow, log_mass: Float[Array, "B 1"] | None = None
) -> Float[Array, "B 1"]:
    """The smallest logit each row keeps under top-p (smallest set with mass >= top_p) and min-p
    (probability >= min_p x the top one), given its candidate logits sorted descending; `log_mass`:
    the log-sum-exp the probabilities are taken against, when the candidates are only the top of it."""
    probs = jax.nn.softmax(sorted_desc, axis=-1) if log_mass is None else jnp.exp(sorted_desc - log_mass)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < _col(top_p)) & (probs >= _col(min_p) * probs[:, :1])
    return jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)


def filter_logits(
    logits: Float[Array, "B V"], *, top_k: PerRowInt = 0, top_p: PerRow = 1.0, min_p: PerRow = 0.0
) -> Float[Array, "B V"]:
    """Set to -inf every logit outside the top-k (0 = off), top-p and min-p sets of its row."""
    v = logits.shape[-1]
    top_k = _col(top_k)
    sorted_desc = -jnp.sort(-logits, axis=-1)
    kth = jnp.take_along_axis(
        sorted_desc, jnp.broadcast_to(jnp.clip(top_k - 1, 0, v - 1), (logits.shape[0], 1)), axis=-1
    )
    sorted_desc = jnp.where((top_k <= 0) | (sorted_desc >= kth), sorted_desc, -jnp.inf)
    keep = ((top_k <= 0) | (logits >= kth)) & (logits >= top_p_min_p_cutoff(sorted_desc, top_p, min_p))
    return jnp.where(keep, logits, -jnp.inf)


def sample_logits(
    logits: Float[Array, "B V"], key: jax.Array, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0
) -> Int[Array, " B"]:
    """One token per row; temperature 0 is greedy (argmax)."""
    if temperature == 0.0:
        return argmax(logits)
    logits = filter_logits(logits.astype(jnp.float32) / temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
