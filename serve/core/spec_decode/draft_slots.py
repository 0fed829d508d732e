"""The scheduler's side of the draft_model proposer: how many tokens each decode drafts."""

from __future__ import annotations

from serve.core.sequence import Sequence


class DraftSlots:
    """k drafts a decode, or fewer where max_tokens / max_model_len leave less room. The tokens are
    made on device by the draft model in the step that verifies them (serve/core/spec_decode/draft_model.py);
    on the host, token 0 stands in for them."""

    def __init__(self, k: int) -> None:
        self.k = k

    lookahead = 0  # KV slots a step needs past its own tokens
    has_cache = True  # the draft's KV pool must hold every position to draft well

    def propose_seqs(self, seqs: list[Sequence], max_new: list[int]) -> list[list[int]]:
        """Stand-in drafts, as NgramProposer.propose_seqs: min(k, room) per row."""
        return [[0] * min(self.k, room) for room in max_new]
