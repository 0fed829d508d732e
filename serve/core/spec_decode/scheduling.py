"""The scheduler's speculative-decoding policy: which running decodes draft and how many tokens, the
KV slots a proposer writes past a step (EAGLE), the rollback of rejected drafts, and the counters."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import numpy as np

from serve.core.sequence import Sequence
from serve.core.spec_decode.stats import SpecDecodingStats
from serve.core.step_data import SchedulerOutput, StepResult

if TYPE_CHECKING:
    from serve.core.spec_decode.proposer import HostProposer


def plain_sampling(seq: Sequence) -> bool:
    """Sampling the rejection sampler serves: no logprobs, penalties, logit bias or grammar."""
    p = seq.params
    return (
        p.logprobs is None
        and not seq.wants_prompt_logprobs
        and not p.uses_penalties
        and not p.logit_bias
        and seq.matcher is None
    )


class SpecScheduling:
    """Drafts for decodes while at most `disable_above` sequences run (None: at any count)."""

    def __init__(self, proposer: HostProposer, disable_above: int | None, max_model_len: int) -> None:
        self.proposer = proposer
        self.k = proposer.k
        self.disable_above = disable_above
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats(proposer.k)
        self.drafted = False  # the last step scheduled verifies drafts: its results settle computed counts

    def may_draft(self, num_running: int) -> bool:
        """Few enough sequences run for speculation."""
        return self.disable_above is None or num_running <= self.disable_above

    def needs_sync(self, num_running: int) -> bool:
        """Steps are synchronous while drafting: drafts come from the tokens on the host, and a verify
        step emits a variable count (with speculation off they stay asynchronous)."""
        return self.drafted or self.may_draft(num_running)

    def propose(
        self, running: Seq[Sequence], waiting: Iterable[Sequence], budget: Callable[[Sequence], int]
    ) -> dict[int, list[int]]:
        """The proposer's drafts for running decodes (seq id -> tokens), when every sequence in the
        engine takes plain sampling and few enough run; `budget`: tokens a sequence may still make."""
        if not running or not self.may_draft(len(running)):
            return {}
        if not all(plain_sampling(s) for s in (*running, *waiting)):
            return {}
        decodes = [
            s
            for s in running
            if s.num_computed_tokens == len(s.tokens) - 1
            and not s.num_pending
            and s.proposer_cache_whole  # a device proposer's cache has no gap (see note_gaps)
        ]
        room = [max(min(budget(s) - 1, self.max_model_len - s.num_tokens - 1), 0) for s in decodes]
        proposed = self.proposer.propose_seqs(decodes, room)
        return {s.seq_id: d for s, d in zip(decodes, proposed) if d}

    def lookahead(self, seq: Sequence, n: int) -> int:
        """KV slots past a step's `n` tokens that the proposer writes (EAGLE's drafts), within max_model_len."""
        return max(min(self.proposer.lookahead, self.max_model_len - seq.num_computed_tokens - n), 0)

    def draft_ids(self, scheduled: list[tuple[Sequence, int]], drafts: dict[int, list[int]]) -> np.ndarray | None:
        """[S, k] the drafts each scheduled row verifies (-1 pads; None when none drafts)."""
        self.drafted = bool(drafts)
        if not drafts:
            return None
        ids = np.full((len(scheduled), self.k), -1, np.int32)
        for row, (seq, count) in enumerate(scheduled):
            d = drafts.get(seq.seq_id, [])[: count - 1]  # the budget may have cut the draft short
            ids[row, : len(d)] = d
        return ids

    def settle(self, sched: SchedulerOutput, num_emitted: np.ndarray, made: list[int]) -> list[int]:
        """Tokens each row emitted; a row's rejected drafts are uncomputed (their KV slots are
        overwritten later), and the acceptance counted."""
        assert sched.draft_ids is not None
        num_draft = (sched.draft_ids >= 0).sum(axis=1)
        emitted = np.where(np.asarray(made) > 0, num_emitted[: len(sched.seqs)], 0)
        accepted = np.maximum(emitted - 1, 0)
        for seq, rejected in zip(sched.seqs, (num_draft - accepted).tolist()):
            if rejected and not seq.is_finished:
                seq.num_computed_tokens -= rejected
        self.stats.observe(num_draft, accepted)
        return emitted.tolist()

    def before_step(self, sched: SchedulerOutput) -> None:
        """A step was scheduled: the proposer's hook (before the step's tokens are counted computed)."""
        self.proposer.before_step(sched)

    def after_step(self, sched: SchedulerOutput, res: StepResult) -> None:
        """A step's results came back: the proposer's hook (EAGLE keeps each row's next drafts)."""
        self.proposer.after_step(sched, res)
