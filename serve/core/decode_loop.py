"""When a step may run several decode steps in one jitted loop (EngineArgs.num_scheduler_steps)."""

from __future__ import annotations

from collections.abc import Callable

from serve.core.kv_cache import BlockManager
from serve.core.loop_stream import streams_in_loop
from serve.core.sequence import Sequence
from serve.sampling_params import MAX_BANNED_STOP_IDS


def loop_steps(
    scheduled: list[tuple[Sequence, int]],
    num_scheduler_steps: int,
    admissible: bool,
    stream_loops: bool,
    bm: BlockManager,
    budget: Callable[[Sequence], int],
) -> int:
    """`num_scheduler_steps` when the batch is decode-only and not empty, no waiting sequence could join
    it now (`admissible`: one that waits for a free row does not break loops), no sequence needs
    penalties or a token mask, and the pool has the blocks for each row's `budget` (allocated here);
    else 1. A stream (output kind "delta") loops only when the loop's tokens are streamed as
    they are made (`stream_loops`): otherwise a loop's burst would reach it."""
    k = num_scheduler_steps
    if k == 1 or admissible or not scheduled or any(n != 1 for _, n in scheduled):
        return 1
    if any(
        s.params.uses_penalties
        or s.matcher is not None
        or (s.params.output_kind == "delta" and not (stream_loops and streams_in_loop(s, s.num_computed_tokens)))
        or len(s.params.stop_token_ids) > MAX_BANNED_STOP_IDS
        for s, _ in scheduled
    ):
        return 1
    for s, _ in scheduled:
        if not bm.allocate_slots(s, min(k, budget(s))):
            return 1
    return k
