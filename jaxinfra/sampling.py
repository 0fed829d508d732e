"""Token sampling from logits: greedy, temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def filter_logits(logits: Float[Array, "B V"], *, top_k: int = 0, top_p: float = 1.0) -> Float[Array, "B V"]:
    """Set to -inf every logit outside the top-k and outside the smallest set with mass >= top_p."""
    if top_k > 0:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < top_p
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def sample_logits(
    logits: Float[Array, "B V"], key: jax.Array, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0
) -> Int[Array, "B"]:
    """One token per row; temperature 0 is greedy (argmax)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = filter_logits(logits.astype(jnp.float32) / temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
