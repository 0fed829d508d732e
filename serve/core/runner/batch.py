"""The runner's persistent batch: per-sequence rows of numpy columns kept across steps."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import numpy as np

from serve.core.sampler import ROW_FIELDS, SamplingTensors, row_settings
from serve.core.sequence import Sequence
from serve.sampling_params import MAX_BANNED_STOP_IDS, MAX_LOGIT_BIAS

_seq_id = operator.attrgetter("seq_id")
_block_ids = operator.attrgetter("block_ids")


class SlotTable:
    """Per-sequence rows kept across steps (vLLM's persistent batch): a sequence's sampling settings
    are written once, when it is first scheduled, and its block ids as it grows; a step gathers its
    rows with one indexing operation per field instead of a Python loop."""

    def __init__(self, capacity: int, max_blocks: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.blocks = np.zeros((capacity, max_blocks), np.int32)
        self.num_blocks = np.zeros(capacity, np.int32)
        self.settings: dict[str, np.ndarray] = {
            name: np.full(capacity, pad, dtype) for name, (dtype, pad) in ROW_FIELDS.items()
        }
        self.stop_ids = np.full((capacity, MAX_BANNED_STOP_IDS), -1, np.int32)
        self.prompt_len = np.zeros(capacity, np.int32)
        self.resample = np.zeros(capacity, bool)  # penalties, a structured output or a logit bias
        self.bias_ids = np.full((capacity, MAX_LOGIT_BIAS), -1, np.int32)
        self.bias_values = np.zeros((capacity, MAX_LOGIT_BIAS), np.float32)
        self.prompt_logprobs = np.zeros(capacity, bool)
        self.slot_of: dict[int, int] = {}
        self.free = list(range(capacity - 1, -1, -1))
        self._gathered: tuple[bytes, int, SamplingTensors] | None = None  # the last sampling() rows' columns

    def row(self, seq: Sequence) -> int:
        """The sequence's row, written on first use; its block ids brought up to date."""
        slot = self.slot_of.get(seq.seq_id)
        if slot is None:
            slot = self.slot_of[seq.seq_id] = self.free.pop()
            self._gathered = None
            p = seq.params
            for name, value in row_settings(p, seq.seed, seq.index, self.vocab_size).items():
                self.settings[name][slot] = value
            ids = p.stop_token_ids[:MAX_BANNED_STOP_IDS]
            self.stop_ids[slot] = -1
            self.stop_ids[slot, : len(ids)] = ids
            self.prompt_len[slot] = seq.prompt_len
            self.resample[slot] = p.uses_penalties or p.structured_outputs is not None or bool(p.logit_bias)
            bias = p.logit_bias or {}
            self.bias_ids[slot], self.bias_values[slot] = -1, 0.0
            self.bias_ids[slot, : len(bias)] = list(bias)
            self.bias_values[slot, : len(bias)] = list(bias.values())
            self.prompt_logprobs[slot] = seq.wants_prompt_logprobs
            self.num_blocks[slot] = 0
        have, want = int(self.num_blocks[slot]), len(seq.block_ids)
        if have != want:
            have = have if have < want else 0  # blocks only grow while a sequence keeps its row
            self.blocks[slot, have:want] = seq.block_ids[have:]
            self.num_blocks[slot] = want
        return slot

    def rows(self, seqs: list[Sequence]) -> np.ndarray:
        """The sequences' rows [len(seqs)]: looked up in C while every one has a row (new sequences
        go through `row()`), block ids copied only for rows whose block count changed."""
        n = len(seqs)
        try:
            rows = np.fromiter(map(self.slot_of.__getitem__, map(_seq_id, seqs)), np.int32, n)
        except KeyError:
            return np.fromiter(map(self.row, seqs), np.int32, n)
        grown = np.fromiter(map(len, map(_block_ids, seqs)), np.int32, n) != self.num_blocks[rows]
        for i in np.flatnonzero(grown).tolist():
            self.row(seqs[i])
        return rows

    def release(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.free.append(slot)

    def bias(self, rows: np.ndarray, sb: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows' logit_bias (ids, values) [sb, MAX_LOGIT_BIAS]; -1 ids pad."""
        ids, values = np.full((sb, MAX_LOGIT_BIAS), -1, np.int32), np.zeros((sb, MAX_LOGIT_BIAS), np.float32)
        ids[: len(rows)], values[: len(rows)] = self.bias_ids[rows], self.bias_values[rows]
        return ids, values

    def sampling(self, rows: np.ndarray, sb: int, out_pos: np.ndarray) -> SamplingTensors:
        """The sampler's [sb] rows: the given rows, then padding rows (greedy, no filters). The
        settings columns gathered for the last call are reused while its rows are the same."""
        n = len(rows)
        key = rows.tobytes()
        if self._gathered is not None and self._gathered[:2] == (key, sb):
            out: Any = np.zeros(sb, np.int32)  # numpy, as every field here
            out[:n] = out_pos
            return dataclasses.replace(self._gathered[2], out_pos=out)

        def padded(col: np.ndarray, pad: float | int | bool, values: np.ndarray) -> np.ndarray:
            out = np.full((sb, *col.shape[1:]), pad, col.dtype)
            out[:n] = values
            return out

        fields: dict[str, Any] = {
            name: padded(col, ROW_FIELDS[name][1], col[rows]) for name, col in self.settings.items()
        }
        fields["out_pos"] = padded(self.prompt_len, 0, out_pos)
        fields["stop_ids"] = padded(self.stop_ids, -1, self.stop_ids[rows])
        tensors = SamplingTensors(**fields)  # numpy here; jax arrays inside the jitted step
        self._gathered = (key, sb, tensors)
        return tensors
