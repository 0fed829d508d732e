"""The scheduler's side of the draft_model proposer: how many tokens each decode drafts."""

from __future__ import annotations

from serve.core.sequence import Sequence
from serve.core.step_data import SchedulerOutput, StepResult


def note_gaps(sched: SchedulerOutput) -> None:
    """A device proposer's KV pool must hold every position to draft well. With auto-off it skips the
    step (no draft KV written): the sequences in it draft no more until a preemption recomputes them."""
    for seq in sched.seqs:
        if seq.num_computed_tokens == seq.num_cached_tokens:  # admitted: its KV is computed afresh
            seq.proposer_cache_whole = True
        if not sched.may_draft:
            seq.proposer_cache_whole = False


class DraftSlots:
    """k drafts a decode, or fewer where max_tokens / max_model_len leave less room. The tokens are
    made on device by the draft model in the step that verifies them (serve/core/spec_decode/draft_model.py);
    on the host, token 0 stands in for them."""

    def __init__(self, k: int) -> None:
        self.k = k

    lookahead = 0  # KV slots a step needs past its own tokens

    def propose_seqs(self, seqs: list[Sequence], max_new: list[int]) -> list[list[int]]:
        """Stand-in drafts, as NgramProposer.propose_seqs: min(k, room) per row."""
        return [[0] * min(self.k, room) for room in max_new]

    def before_step(self, sched: SchedulerOutput) -> None:
        """The draft's cache gaps (note_gaps)."""
        note_gaps(sched)

    def after_step(self, sched: SchedulerOutput, res: StepResult) -> None:
        """Nothing: the drafts were made and verified in the step."""
