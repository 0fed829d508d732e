"""Continuous-batching scheduler with chunked prefill and recompute preemption (vLLM V1 style)."""

from __future__ import annotations

import bisect
import collections
import dataclasses
from typing import Any

from serve.kv_cache import BlockManager
from serve.sequence import Sequence, Status


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]]  # (sequence, new tokens computed this step)
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for _, n in self.scheduled)


def _rank(seq: Sequence) -> Any:
    return seq.rank


class Scheduler:
    """Each step spends `max_num_batched_tokens` over at most `max_num_seqs` sequences: running ones
    first (decodes and unfinished prompt chunks), then waiting prompts. When blocks run out, the
    newest running sequence is preempted (blocks freed, recomputed later). With the priority
    policy, both queues are kept in (priority, arrival) order: the most urgent are admitted first
    and the least urgent preempted first.

    Asynchronous scheduling: a running sequence whose last sampled token is still on the device is
    scheduled for it (the runner feeds it from the device); a waiting one is not admitted until its
    tokens are known, and one that has reached max_tokens is not scheduled again."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.by_priority = policy == "priority"
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = Status.WAITING
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=_rank)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and free its blocks."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = Status.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        self.num_preemptions += 1
        self.add(seq, front=True)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        bs = self.bm.block_size
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            total = len(seq.tokens) + seq.num_pending
            n = min(total - seq.num_computed_tokens, budget)
            if n <= 0 or total - seq.prompt_len >= seq.max_output:
                i += 1  # nothing to compute, or max_tokens already in flight
                continue
            grows = -(-(seq.num_computed_tokens + n) // bs) > len(seq.block_ids)
            while grows and not self.bm.allocate_slots(seq, n):
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:
                break  # its last token is still on the device
            if not seq.block_ids:
                seq.num_computed_tokens = seq.num_cached_tokens = self.bm.allocate_prefix(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            # Without chunking a prompt waits for a step with room for all of it (the budget holds
            # max_model_len); and for blocks when the pool is short.
            if (n < remaining and not self.enable_chunked_prefill) or not self.bm.allocate_slots(seq, n):
                self.bm.free(seq)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if self.by_priority:
                bisect.insort(self.running, seq, key=_rank)
            else:
                self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return SchedulerOutput(scheduled, preempted)
