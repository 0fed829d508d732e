"""The scheduler's side of the EAGLE proposer: drafts made on device by the head after each step
(serve/core/spec_decode/eagle.py), kept on each sequence until its next step verifies them."""

from __future__ import annotations

from serve.core.sequence import Sequence


class EagleDrafts:
    """The scheduler's side: each decode's drafts are those its last step made on device."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.lookahead = k  # KV slots past a step's tokens: the head writes its drafts' there
        self.has_cache = True  # the head's KV pool must hold every position to draft well

    def propose_seqs(self, seqs: list[Sequence], max_new: list[int]) -> list[list[int]]:
        """Each row's device-made drafts, at most max_new[b] (as NgramProposer.propose_seqs)."""
        return [s.next_drafts[:room] for s, room in zip(seqs, max_new)]
