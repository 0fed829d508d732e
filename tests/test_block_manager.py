"""BlockManager and Scheduler on their own: example cases, and hypothesis state machines that run
random operation sequences and check every invariant after each operation."""

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from serve import EngineArgs, SamplingParams
from serve.core.kv_cache import BlockManager
from serve.core.layout import CoreLayout
from serve.core.scheduler import Scheduler
from serve.core.sequence import Sequence, Status
from serve.kv_transfer.shm_connector import SharedMemoryConnector

PARAMS = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)


def _seq(tokens, salt=None):
    return Sequence("r", 0, list(tokens), PARAMS, 0, salt)


def test_allocation_grows_by_blocks_and_refuses_when_short():
    bm = BlockManager(4, 4)
    s = _seq(range(6))
    assert bm.allocate_slots(s, 6) and len(s.block_ids) == 2 and bm.num_free_blocks == 2
    s.num_computed_tokens = 6
    assert bm.allocate_slots(s, 2) and len(s.block_ids) == 2  # 8 tokens still fit in 2 blocks
    assert bm.allocate_slots(s, 3) and len(s.block_ids) == 3
    assert not bm.allocate_slots(s, 11) and len(s.block_ids) == 3  # needs 2 more, 1 free: nothing taken
    bm.free(s)
    assert bm.num_free_blocks == 4 and s.block_ids == [] and s.num_computed_tokens == 0


def test_prefix_hits_share_blocks_and_leave_the_last_token():
    bm = BlockManager(16, 4)
    a = _seq(range(12))
    assert bm.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    b = _seq(range(12))
    assert bm.allocate_prefix(b) == 8  # the third block would leave no token to compute
    assert b.block_ids == a.block_ids[:2] and bm.ref_counts[a.block_ids[0]] == 2
    bm.check_invariants([a, b])
    assert bm.prefix_queries == 12 and bm.prefix_hits == 8


def test_freed_cached_blocks_are_evicted_least_recent_first_and_forgotten():
    bm = BlockManager(3, 2)
    a = _seq([1, 2, 3, 4, 5])
    assert bm.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    bm.free(a)  # tail first: the partial block, then [3, 4], then [1, 2]
    b = _seq([9, 9, 9])
    assert bm.allocate_slots(b, 3)  # takes the partial block and [3, 4]
    assert bm.allocate_prefix(_seq([1, 2, 3, 4, 5])) == 2  # [1, 2] survived, [3, 4] was evicted
    bm.reset_prefix_cache()
    assert bm.allocate_prefix(_seq([1, 2, 3])) == 0


def _rows(out):
    return list(zip(out.seqs, out.num_new.tolist()))


def test_scheduler_budget_chunking_and_preemption():
    """The scheduler counts what it schedules as computed, and a finished prompt's token as pending."""
    bm = BlockManager(6, 4)
    sched = Scheduler(bm, CoreLayout(max_num_seqs=4, max_num_batched_tokens=8))
    a, b = _seq(range(10)), _seq(range(100, 105))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert _rows(out) == [(a, 8)] and (a.num_computed_tokens, a.num_pending) == (8, 0)  # the budget's first chunk
    out = sched.schedule()
    assert _rows(out) == [(a, 2), (b, 5)] and (a.num_pending, b.num_pending) == (1, 1)
    a.num_pending = b.num_pending = 0  # the step's results: a's token, and b's (and two more)
    a.tokens.append(1)
    b.tokens += [2, 3, 4]  # b needs a third block; a holds 3 of 6, b 2, one free
    out = sched.schedule()
    assert out.preempted == [] and set(out.seqs) == {a, b}
    bm.check_invariants(sched.running)


@pytest.mark.parametrize("per_decode,buckets", [(0, []), (1, []), (1, [16, 32, 64])])
def test_prefill_tokens_per_decode_caps_prompt_tokens_while_sequences_decode(per_decode, buckets):
    """With the cap, a step that carries decodes takes at most per_decode x max(running, 16) prompt tokens
    (waiting prompts and unfinished chunks alike), stretched to fill the token bucket the step pads to;
    without running sequences, or the cap, the budget."""
    bm = BlockManager(64, 4)
    layout = CoreLayout(8, 64, prefill_tokens_per_decode=per_decode, token_buckets=tuple(buckets))
    sched = Scheduler(bm, layout)
    a, b, c = _seq(range(20)), _seq(range(100, 140)), _seq(range(200, 230))
    sched.add(a)
    assert _rows(sched.schedule()) == [(a, 20)]  # nothing runs: the whole budget
    a.num_pending = 0
    a.tokens.append(1)
    sched.add(b)
    sched.add(c)
    if not per_decode:
        assert _rows(sched.schedule()) == [(a, 1), (b, 40), (c, 23)]
    elif not buckets:
        assert _rows(sched.schedule()) == [(a, 1), (b, 16)]
        a.num_pending = 0
        a.tokens.append(2)
        assert _rows(sched.schedule()) == [(a, 1), (b, 16)]  # b's next chunk counts against the cap too
    else:
        assert _rows(sched.schedule()) == [(a, 1), (b, 31)]  # 1 + 16 pads to 32: filled
        a.num_pending = 0
        a.tokens.append(2)
        assert _rows(sched.schedule()) == [(a, 1), (b, 9), (c, 22)]
    bm.check_invariants([a, b, c])


def test_decode_loops_while_the_waiting_have_no_free_row():
    """A decode-only batch loops num_scheduler_steps unless a waiting prompt could join it now: one that
    waits for a free row (max_num_seqs taken) does not break the loop; each row loops within its budget."""
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, CoreLayout(max_num_seqs=2, max_num_batched_tokens=64, num_scheduler_steps=4))
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    a, b = _seq(range(5)), Sequence("r", 1, list(range(10, 15)), short, 0, None)
    for seq in (a, b):
        sched.add(seq)
    sched.schedule()
    for seq in (a, b):
        seq.num_pending = 0
        seq.tokens.append(1)
    c = _seq(range(20, 25))
    sched.add(c)  # no row for it
    out = sched.schedule()
    assert _rows(out) == [(a, 1), (b, 1)] and out.num_steps == 4
    assert (a.num_pending, b.num_pending) == (4, 2)  # b's loop stops at max_tokens
    sched.remove(b)
    a.num_pending = 0
    a.tokens += [1] * 4
    out = sched.schedule()  # a row is free: c joins, a single step
    assert _rows(out) == [(a, 1), (c, 5)] and out.num_steps == 1
    bm.check_invariants([a, c])


def test_sequences_with_loaded_kv_are_not_stuck_behind_a_head_short_of_blocks():
    """Disaggregation: sequences whose remote KV loaded wait holding their blocks; a preempted sequence put
    back at the head cannot get blocks while they hold them, so they are admitted first (they need at most
    one more block each), not left behind it forever."""
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, CoreLayout(max_num_seqs=4, max_num_batched_tokens=16), connector=SharedMemoryConnector(4))
    loaded = [Sequence(f"loaded{i}", 0, list(range(13)), PARAMS, 0, None) for i in range(2)]
    for seq in loaded:  # what RemoteLoads.start and the worker leave: every prompt token but the last in place
        assert bm.allocate_slots(seq, 12)
        seq.num_computed_tokens = 12
        sched.remote.loading[seq.seq_id] = seq
    sched.finish_loads({s.request_id for s in loaded}, set())
    head = Sequence("preempted", 0, list(range(100, 140)), PARAMS, 0, None)
    sched.add(head, front=True)  # its 16-token chunk needs 4 blocks, 2 are free
    assert set(_rows(sched.schedule())) == {(loaded[0], 1), (loaded[1], 1)}
    assert list(sched.waiting) == [head] and bm.num_free_blocks == 0


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / compute / cache / free / prefix-hit sequences over a small pool."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(12, 4)
        self.live: list[Sequence] = []

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30), salt=st.sampled_from([None, "a"]))
    def admit(self, tokens, salt):
        seq = _seq(tokens, salt)
        seq.num_computed_tokens = self.bm.allocate_prefix(seq)
        if self.bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens):
            self.live.append(seq)
        else:
            self.bm.free(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute(self, data):
        seq = data.draw(st.sampled_from(self.live))
        seq.num_computed_tokens = seq.num_tokens
        self.bm.cache_full_blocks(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def grow(self, data, new):
        seq = data.draw(st.sampled_from(self.live))
        if seq.num_computed_tokens == seq.num_tokens and self.bm.allocate_slots(seq, len(new)):
            seq.tokens += new

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free(seq)

    @invariant()
    def bookkeeping_agrees(self):
        self.bm.check_invariants(self.live)
        for seq in self.live:  # every cached block a sequence holds really holds its tokens
            for i, block in enumerate(seq.block_ids[: len(seq.block_hashes)]):
                cached = self.bm.cached.get(block)
                if cached is not None:
                    assert cached.tokens == tuple(seq.tokens[i * 4 : (i + 1) * 4])
                    assert cached.salt == seq.cache_salt


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, steps (every scheduled token computed, decodes sample a token) and aborts:
    budgets and sequence limits hold, and the pool is whole once everything is gone."""

    layout = CoreLayout(max_num_seqs=3, max_num_batched_tokens=8)

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(10, 4, enable_prefix_caching=True)
        self.sched = Scheduler(self.bm, self.layout)
        self.seqs: list[Sequence] = []

    @rule(n=st.integers(1, 20), prefix=st.booleans())
    def arrive(self, n, prefix):
        seq = _seq(([7] * 8 if prefix else []) + list(range(n)))
        self.seqs.append(seq)
        self.sched.add(seq)

    @rule()
    def step(self):
        out = self.sched.schedule()  # counts what it schedules as computed
        assert out.total_tokens <= 8 and len(self.sched.running) <= 3
        for seq in out.seqs:
            assert seq.status is Status.RUNNING and len(seq.block_ids) * 4 >= seq.num_computed_tokens
            if seq.num_pending:  # its prompt is done: the step sampled a token
                seq.num_pending = 0
                seq.tokens.append(5)
                if seq.num_tokens >= 32:
                    self.sched.remove(seq)

    @precondition(lambda self: any(not s.is_finished for s in self.seqs))
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from([s for s in self.seqs if not s.is_finished]))
        self.sched.remove(seq)

    @invariant()
    def bookkeeping_agrees(self):
        live = [*self.sched.running, *self.sched.waiting]
        self.bm.check_invariants(live)
        if not live:
            assert self.bm.num_free_blocks == self.bm.num_blocks


class PairCappedSchedulerMachine(SchedulerMachine):
    """The same with prompt chunks capped in query-key pairs (16 a step beside decodes): chunks past
    position 16 wait for saved pairs, and nothing else changes."""

    layout = CoreLayout(max_num_seqs=3, max_num_batched_tokens=8, prefill_tokens_per_decode=1, pairs_per_token=1)


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPairCappedScheduler = PairCappedSchedulerMachine.TestCase
TestPairCappedScheduler.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_size", 12),
        ("dtype", "int4"),
        ("kv_cache_dtype", "fp4"),
        ("attn_impl", "cudnn"),
        ("max_model_len", 0),
        ("max_num_seqs", -1),
        ("max_num_seqs", True),
        ("num_scheduler_steps", 0),
        ("tensor_parallel_size", 0),
        ("gpu_memory_utilization", 1.5),
        ("async_scheduling", "yes"),
        ("seed", 1.5),
        ("prefill_tokens_per_decode", -1),
        ("prefill_pairs_per_token", -1),
        ("prefill_pairs_per_token", 2.5),
        ("cpu_reserved_cores", -1),
        ("cpu_reserved_cores", 0.5),
    ],
)
def test_bad_engine_args_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"EngineArgs.{field}"):
        EngineArgs(**{field: value})


def test_engine_args_cross_checks(tmp_path):
    from tests.serve_helpers import engine

    with pytest.raises(ValueError, match="max_num_batched_tokens .* max_model_len"):
        engine(enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=64)
    with pytest.raises(ValueError, match="max_num_batched_tokens .* max_num_seqs"):
        engine(max_num_batched_tokens=4, max_num_seqs=8)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine(max_model_len=10**6)
    (tmp_path / "x.yaml").write_text("block_size: 16\nmax_num_seq: 3\n")
    with pytest.raises(ValueError, match="unknown engine argument.*max_num_seq"):
        EngineArgs.from_yaml(tmp_path / "x.yaml")
