"""Pack tokenized documents into fixed-length rows: (inputs, targets) pairs of each document share a
segment id and restart positions, so attention and the loss never cross a document; padding has segment 0."""

from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np


def chunk_tokens(tokens: Sequence[int], seq_len: int) -> list[dict[str, np.ndarray]]:
    """One document's tokens -> (inputs, targets) pieces of at most `seq_len` predictions each; a long
    document continues in the next piece (its positions restart there, as in truncation-based packers)."""
    ids = np.asarray(tokens, np.int32)
    inputs, targets = ids[:-1], ids[1:]
    return [
        {"inputs": inputs[i : i + seq_len], "targets": targets[i : i + seq_len]} for i in range(0, len(inputs), seq_len)
    ]


def _to_batch_keys(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    seg = row["inputs_segment_ids"].astype(np.int32)
    return {
        "input_ids": row["inputs"].astype(np.int32),
        "targets": row["targets"].astype(np.int32),
        "segment_ids": seg,
        "positions": row["inputs_positions"].astype(np.int32),
        "loss_mask": (seg > 0).astype(np.int32),
    }


def pack_rows(pieces: grain.IterDataset, seq_len: int, num_bins: int) -> grain.IterDataset:
    """First-fit packing of (inputs, targets) pieces into rows of `seq_len` (grain keeps the state)."""
    packed = grain.experimental.FirstFitPackIterDataset(
        pieces, length_struct={"inputs": seq_len, "targets": seq_len}, num_packing_bins=num_bins, shuffle_bins=False
    )
    return packed.map(_to_batch_keys)
