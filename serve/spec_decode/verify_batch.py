"""The host side of a verify step: which logits each row's k+1 positions read in the flat batch."""

from __future__ import annotations

import numpy as np
from jaxtyping import Int


def verify_arrays(
    draft_ids: Int[np.ndarray, "S K"], last_index: Int[np.ndarray, " S"], sb: int
) -> tuple[Int[np.ndarray, "SB K"], Int[np.ndarray, "SB K1"]]:
    """Drafts padded to sb rows (-1: none) and, per row, the flat-batch indices of its k+1 target
    positions: its last known token, then each draft token; positions past its drafts repeat the last."""
    n, k = draft_ids.shape
    drafts = np.full((sb, k), -1, np.int32)
    drafts[:n] = draft_ids
    last = np.zeros(sb, np.int32)
    last[:n] = last_index
    first = last - (drafts >= 0).sum(axis=1)
    indices = np.minimum(first[:, None] + np.arange(k + 1), last[:, None]).astype(np.int32)
    return drafts, indices
