"""A step as plain data: what the scheduler hands the runner (SchedulerOutput) and what the runner
hands back (StepResult), numpy on the host."""

from __future__ import annotations

import dataclasses

import numpy as np

from serve.core.sequence import Sequence

LogprobArrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # log p(chosen), top ids, top logprobs


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """One step as data: the sequences in row order and, per row, counts taken when it was scheduled.

    A decode loop (num_steps > 1) runs up to `budgets` steps per row; the scheduler counts every row
    as making its whole budget (a row stops early only by finishing), so the next step is scheduled
    while the loop runs. `finished` and `preempted` rows left the batch since the last step."""

    seqs: list[Sequence]
    num_new: np.ndarray  # tokens each row computes this step
    num_computed: np.ndarray  # tokens each had in the KV cache before
    num_tokens: np.ndarray  # tokens each had (known and on the device) before
    num_pending: np.ndarray  # of which still on the device
    preempted: list[Sequence] = dataclasses.field(default_factory=list)
    finished: list[int] = dataclasses.field(default_factory=list)  # seq ids
    num_steps: int = 1
    budgets: np.ndarray | None = None  # decode loop: tokens each row may make
    draft_ids: np.ndarray | None = None  # speculative: [S, k] draft tokens each row verifies (-1 pads)
    step_id: int = 0  # the non-empty steps scheduled before this one: results apply in this order
    may_draft: bool = False  # speculation is on (few enough run): a device proposer drafts after this step

    @property
    def samples(self) -> np.ndarray:
        """bool per row: its prompt is done, so it samples a token."""
        return self.num_computed + self.num_new >= self.num_tokens

    @property
    def total_tokens(self) -> int:
        return int(self.num_new.sum())


@dataclasses.dataclass
class StepResult:
    """Host copies of what a step produced, rows in scheduled order; a decode loop's are [K, S, ...]."""

    tokens: np.ndarray
    num_emitted: np.ndarray | None = None  # speculative: [S] tokens each row emitted (tokens is [S, k+1])
    logprobs: LogprobArrays | None = None  # sampled tokens': [S], [S, MAX_LOGPROBS] x 2
    prompt_logprobs: LogprobArrays | None = None  # per prompt token: log p(next prompt token), top ids, top
    expert_counts: np.ndarray | None = None  # MoE models: token copies per expert [MoE layers, experts]
    drafts: np.ndarray | None = None  # EAGLE: [S, k] drafts each row's next step verifies (-1 pads)
