"""Host-side finishing of pooled vectors: Matryoshka truncation, normalization, and scores (a
cross-encoder's sigmoid or the embeddings' cosine)."""

from __future__ import annotations

import numpy as np


def finish_embeddings(raw: np.ndarray, normalize: bool, dimensions: int | None = None) -> np.ndarray:
    """`raw` [N, E] cut to its first `dimensions` (Matryoshka), then scaled to unit length if
    `normalize`; a ValueError naming `dimensions` when it is not in [1, E]."""
    if dimensions is not None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= raw.shape[-1]:
            raise ValueError(f"dimensions must be an int in [1, {raw.shape[-1]}], got {dimensions!r}")
        raw = raw[..., :dimensions]
    if normalize:
        raw = raw / np.maximum(np.linalg.norm(raw, axis=-1, keepdims=True), 1e-12)
    return raw.astype(np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two [N, E] arrays."""
    return np.sum(finish_embeddings(a, True) * finish_embeddings(b, True), axis=-1)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """A one-label classifier's logits as probabilities (vLLM's score for cross-encoders)."""
    return 1.0 / (1.0 + np.exp(-logits))
