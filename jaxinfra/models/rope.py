"""Rotary position embeddings (half-rotation layout, as in Hugging Face Llama) with HF's scalings:
linear, dynamic NTK, YaRN and Llama 3.1's, each equal to transformers' at any position."""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxinfra.config import RopeScaling


def _base_frequencies(head_dim: int, theta: float) -> np.ndarray:
    return (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))).astype(np.float32)


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1: low frequencies divided by the factor, high ones kept, a smooth blend between."""
    old_len = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / s.low_freq_factor, old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """YaRN: dimensions that turn fewer than beta_slow times over the original length are
    interpolated (divided by the factor), more than beta_fast extrapolated, a linear ramp between."""

    def dim_of(rotations: float) -> float:
        return (
            head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        )

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high += 0.001 if low == high else 0
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)).astype(np.float32)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: RopeScaling | None) -> float:
    """What YaRN multiplies cos and sin by (1 for every other type)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return _yarn_mscale(scaling.factor)


@functools.lru_cache(maxsize=64)
def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Per-pair rotation frequencies [head_dim // 2], float32, after a static scaling (dynamic NTK's
    depend on the sequence: `rope_frequencies`)."""
    if scaling is not None and scaling.rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    inv_freq = _base_frequencies(head_dim, theta)
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    return _llama3(inv_freq, scaling)


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, positions: Int[Array, "B T"]
) -> Float[Array, "B 1 D2"] | np.ndarray:
    """The frequencies `apply_rope` takes for these positions. Dynamic NTK grows the base with each
    row's length (its largest position + 1) past the original length, as transformers does for a
    forward over those positions; every other type is static."""
    if scaling is None or scaling.rope_type != "dynamic":
        return inverse_frequencies(head_dim, theta, scaling)
    original, factor = scaling.original_max_position_embeddings, scaling.factor
    seq_len = jnp.maximum(jnp.max(positions, axis=-1) + 1, original).astype(jnp.float32)  # [B]
    base = theta * (factor * seq_len / original - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    return (1.0 / base[:, None] ** exponents[None, :])[:, None, :]


def apply_rope(
    x: Float[Array, "B T N D"],
    positions: Int[Array, "B T"],
    inv_freq: Float[Array | np.ndarray, "*D2"],
    scale: float = 1.0,
) -> Float[Array, "B T N D"]:
    """Rotate each head's (i, i + D/2) pairs by position * frequency (frequencies [D/2], or [B, 1, D/2]
    per row), cos and sin times `scale` (YaRN's attention factor); math in float32."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    cos = (jnp.cos(angles) * scale)[:, :, None, :]
    sin = (jnp.sin(angles) * scale)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
