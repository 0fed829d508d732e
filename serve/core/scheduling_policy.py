"""Scheduling policies: each owns the waiting queue's order, where an admitted sequence goes in the
running list, and which running sequence a step short of KV blocks preempts.

- fcfs: arrival order; the newest running sequence is preempted first (vLLM's default).
- priority: (priority, arrival) order for both lists; the least urgent is preempted first (vLLM's).
- fair: weighted fair queueing between tenants (start-time fair queueing over tokens computed). Each
  tenant's virtual time grows by the tokens its sequences compute divided by its weight; the next
  admitted is the head of the tenant with the least, and a preemption takes the newest sequence of the
  tenant with the most. A tenant that had nothing waiting joins at the virtual clock (the least time of
  the tenants served in the last step), so idling banks no credit. One tenant alone is exactly fcfs.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterator
from typing import ClassVar

from serve.core.sequence import Sequence

WEIGHT_RANGE = (1e-3, 1e3)


def check_weight(weight: float) -> None:
    """A fair-share weight is a number in WEIGHT_RANGE (ValueError naming it otherwise)."""
    lo, hi = WEIGHT_RANGE
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not lo <= weight <= hi:
        raise ValueError(f"weight must be a number in [{lo:g}, {hi:g}], got {weight!r}")


def _rank(seq: Sequence) -> tuple[int, float, int]:
    return seq.rank


class FcfsPolicy:
    """Arrival order; a preempted sequence goes back to the front of the queue."""

    name: ClassVar[str] = "fcfs"

    def __init__(self) -> None:
        self.queue: collections.deque[Sequence] = collections.deque()

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self.queue)

    def add(self, seq: Sequence, front: bool = False) -> None:
        if front:
            self.queue.appendleft(seq)
        else:
            self.queue.append(seq)

    def head(self) -> Sequence:
        """The next sequence to admit (the queue is not empty)."""
        return self.queue[0]

    def remove(self, seq: Sequence) -> None:
        self.queue.remove(seq)

    def place(self, running: list[Sequence], seq: Sequence) -> None:
        """Put an admitted sequence into the running list (the order preemption reads)."""
        running.append(seq)

    def victim(self, running: list[Sequence], start: int) -> int:
        """The index, at or after `start` (the rows this step has not scheduled yet), to preempt."""
        return len(running) - 1

    def charge(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """The tokens each of a step's sequences computes: what the fair policy counts as service."""


class PriorityPolicy(FcfsPolicy):
    """Both lists in (priority, arrival) order: the most urgent admitted first, the least preempted first."""

    name: ClassVar[str] = "priority"

    def add(self, seq: Sequence, front: bool = False) -> None:
        bisect.insort(self.queue, seq, key=_rank)

    def place(self, running: list[Sequence], seq: Sequence) -> None:
        bisect.insort(running, seq, key=_rank)


class FairPolicy(FcfsPolicy):
    """Weighted fair queueing between tenants, fcfs within one (see the module's docstring)."""

    name: ClassVar[str] = "fair"

    def __init__(self) -> None:
        super().__init__()
        self.queues: dict[str, collections.deque[Sequence]] = {}
        self.vtime: dict[str, float] = {}
        self.clock = 0.0
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for queue in self.queues.values() for seq in queue)

    def add(self, seq: Sequence, front: bool = False) -> None:
        queue = self.queues.get(seq.tenant)
        if queue is None:
            queue = self.queues[seq.tenant] = collections.deque()
            self.vtime[seq.tenant] = max(self.vtime.get(seq.tenant, 0.0), self.clock)
        if front:
            queue.appendleft(seq)
        else:
            queue.append(seq)
        self.count += 1

    def head(self) -> Sequence:
        vtime = self.vtime
        return min((queue[0] for queue in self.queues.values()), key=lambda s: (vtime[s.tenant], s.rank[1:]))

    def remove(self, seq: Sequence) -> None:
        queue = self.queues[seq.tenant]
        queue.remove(seq)
        self.count -= 1
        if not queue:
            del self.queues[seq.tenant]

    def victim(self, running: list[Sequence], start: int) -> int:
        vtime = self.vtime
        return max(range(start, len(running)), key=lambda i: (vtime.get(running[i].tenant, 0.0), i))

    def charge(self, seqs: list[Sequence], tokens: list[int]) -> None:
        if not seqs:
            return
        vtime = self.vtime
        for seq, n in zip(seqs, tokens):
            vtime[seq.tenant] = vtime.get(seq.tenant, 0.0) + n / seq.weight
        self.clock = max(self.clock, min(vtime[seq.tenant] for seq in seqs))


POLICIES: dict[str, type[FcfsPolicy]] = {p.name: p for p in (FcfsPolicy, PriorityPolicy, FairPolicy)}
