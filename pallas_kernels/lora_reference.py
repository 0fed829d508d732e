"""Multi-LoRA reference: every token's delta through its own adapter slot, in plain jax.numpy.

Adapter pools live on the device, one slot per loaded adapter: A [S, in, R], B [S, R, out] and
scaling [S] (alpha / rank). An adapter of rank r < R fills A[s, :, :r] and B[s, :r] and leaves the
rest zero, so padding is exact. Slot -1 means "no adapter": that token's delta is zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

NO_ADAPTER = -1  # the slot of a token that runs without LoRA


def check_pools(x: jax.Array, a: jax.Array, b: jax.Array, scaling: jax.Array) -> None:
    """ValueError naming the argument whose shape does not fit x [T, in], A [S, in, R], B [S, R, out],
    scaling [S]."""
    if x.ndim != 2:
        raise ValueError(f"x must be [tokens, in_dim], got shape {x.shape}")
    if a.ndim != 3 or a.shape[1] != x.shape[1]:
        raise ValueError(f"A must be [slots, in_dim={x.shape[1]}, max_rank], got shape {a.shape}")
    if b.ndim != 3 or b.shape[:2] != (a.shape[0], a.shape[2]):
        raise ValueError(f"B must be [slots={a.shape[0]}, max_rank={a.shape[2]}, out_dim], got shape {b.shape}")
    if scaling.shape != (a.shape[0],):
        raise ValueError(f"scaling must be [slots={a.shape[0]}], got shape {scaling.shape}")


def check_slots(x: jax.Array, slots: jax.Array) -> None:
    if slots.shape != (x.shape[0],):
        raise ValueError(f"slots must be [tokens={x.shape[0]}], got shape {slots.shape}")


def check_segments(seg_starts: jax.Array, seg_slots: jax.Array) -> None:
    g = seg_slots.shape[0] if seg_slots.ndim == 1 else -1
    if g < 1 or seg_starts.shape != (g + 1,):
        raise ValueError(
            f"seg_slots must be [G >= 1] and seg_starts [G + 1], got {seg_slots.shape} and {seg_starts.shape}"
        )


def segment_slots(seg_starts: Int[Array, " G1"], seg_slots: Int[Array, " G"], num_tokens: int) -> Int[Array, " T"]:
    """Per-token slots of a segmented batch: tokens seg_starts[g] <= t < seg_starts[g + 1] use
    seg_slots[g]; tokens past seg_starts[-1] use none."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    g = jnp.clip(jnp.searchsorted(seg_starts, t, side="right") - 1, 0, seg_slots.shape[0] - 1)
    inside = (t >= seg_starts[0]) & (t < seg_starts[-1])
    return jnp.where(inside, seg_slots[g], NO_ADAPTER).astype(jnp.int32)


def lora_delta_reference(
    x: Float[Array, "T IN"],
    slots: Int[Array, " T"],
    a: Float[Array, "S IN R"],
    b: Float[Array, "S R OUT"],
    scaling: Float[Array, " S"],
) -> Float[Array, "T OUT"]:
    """delta[t] = scaling[s] * (x[t] @ A[s]) @ B[s] with s = slots[t] (zero where s is -1), each
    token's matrices gathered, float32 at HIGHEST precision, output in x's dtype."""
    check_pools(x, a, b, scaling)
    check_slots(x, slots)
    on = slots >= 0
    s = jnp.where(on, slots, 0)
    hi = lax.Precision.HIGHEST
    v = jnp.einsum("ti,tir->tr", x.astype(jnp.float32), a[s].astype(jnp.float32), precision=hi)
    y = jnp.einsum("tr,tro->to", v, b[s].astype(jnp.float32), precision=hi)
    return (y * jnp.where(on, scaling[s], 0.0)[:, None]).astype(x.dtype)
