"""vLLM's speculative-decoding counters, kept by the engine core as drafts are verified."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class SpecDecodingStats:
    """Cumulative: drafts (a request's proposal of >= 1 token, verified in one step), draft tokens,
    accepted tokens, and accepted tokens at each draft position."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.num_spec_tokens

    def observe(self, num_draft: np.ndarray, num_accepted: np.ndarray) -> None:
        """One verify step: each row's draft length and how many of its drafts were accepted."""
        drafted = num_draft > 0
        self.num_drafts += int(drafted.sum())
        self.num_draft_tokens += int(num_draft.sum())
        self.num_accepted_tokens += int(num_accepted[drafted].sum())
        for pos in range(self.num_spec_tokens):
            self.accepted_per_pos[pos] += int((num_accepted[drafted] > pos).sum())

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step emits per draft on average (1 + accepted per draft), vLLM's figure."""
        return 1.0 + self.num_accepted_tokens / max(self.num_drafts, 1)
