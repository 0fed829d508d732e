"""The scheduler's side of the EAGLE proposer: drafts made on device by the head after each step
(serve/core/spec_decode/eagle.py), kept on each sequence until its next step verifies them."""

from __future__ import annotations

from serve.core.sequence import Sequence
from serve.core.spec_decode.draft_slots import note_gaps
from serve.core.step_data import SchedulerOutput, StepResult


class EagleDrafts:
    """The scheduler's side: each decode's drafts are those its last step made on device."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.lookahead = k  # KV slots past a step's tokens: the head writes its drafts' there

    def propose_seqs(self, seqs: list[Sequence], max_new: list[int]) -> list[list[int]]:
        """Each row's device-made drafts, at most max_new[b] (as NgramProposer.propose_seqs)."""
        return [s.next_drafts[:room] for s, room in zip(seqs, max_new)]

    def before_step(self, sched: SchedulerOutput) -> None:
        """The head's cache gaps (note_gaps)."""
        note_gaps(sched)

    def after_step(self, sched: SchedulerOutput, res: StepResult) -> None:
        """The drafts the step made on device, kept on each row's sequence for its next step."""
        if res.drafts is None:
            return
        for seq, row in zip(sched.seqs, res.drafts.tolist()):
            seq.next_drafts = [t for t in row if t >= 0]
