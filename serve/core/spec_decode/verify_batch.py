"""A verify step's layout: which logits each row's k+1 positions read in the flat batch (host), and
drafts made on device put into its input tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int


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


def with_drafts(
    input_ids: Int[Array, " T"], drafts: Int[Array, "S K"], indices: Int[Array, "S K1"]
) -> Int[Array, " T"]:
    """The flat batch's input tokens with each row's draft tokens (made on device by the draft model)
    at its draft positions; -1 drafts leave the token there."""
    at = jnp.where(drafts >= 0, indices[:, 1:], input_ids.shape[0])  # out of range: dropped
    return input_ids.at[at.reshape(-1)].set(drafts.reshape(-1), mode="drop")
