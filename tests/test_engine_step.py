"""The step's shape: the runner runs from the scheduler's output data alone, a decode loop does not
force a synchronous step, and streaming requests get one token per output."""

import numpy as np
import pytest

from serve import SamplingParams
from serve.core.sequence import Sequence
from serve.core.step_data import SchedulerOutput
from tests.serve_helpers import GREEDY, engine, prompts, reference


def test_runner_runs_synthetic_scheduler_outputs():
    """A hand-built prefill of two prompts, then a decode fed from the device (its token not yet on
    the host) that also frees a finished row: the reference generator's greedy tokens."""
    eng = engine()
    runner = eng.core.runner
    ps = prompts([5, 11], seed=3)
    ref = reference(ps, 2)
    seqs = [Sequence(f"r{i}", 0, p, GREEDY, 0) for i, p in enumerate(ps)]
    for i, s in enumerate(seqs):
        s.block_ids = [2 * i, 2 * i + 1]  # block size 8: room for 16 tokens each
    n, zero, one = np.array([len(p) for p in ps], np.int32), np.zeros(2, np.int32), np.ones(2, np.int32)
    prefill = runner.dispatch(runner.prepare(SchedulerOutput(seqs, n, zero, n, zero)))
    decode = runner.dispatch(runner.prepare(SchedulerOutput(seqs, one, n, n + 1, one)))
    assert prefill.fetch().tokens[:2].tolist() == [r[0] for r in ref]
    assert decode.fetch().tokens[:2].tolist() == [r[1] for r in ref]
    gone = seqs[0].seq_id
    assert gone in runner.slots.slot_of
    seqs[1].tokens += ref[1][:2]
    runner.prepare(SchedulerOutput(seqs[1:], one[:1], n[1:] + 1, n[1:] + 2, zero[:1], finished=[gone]))
    assert gone not in runner.slots.slot_of


def test_a_row_refilled_by_another_sequence_takes_its_settings():
    """The persistent batch reuses the sampling columns it gathered while a step's rows are the same:
    a finished sequence's row refilled by a new one (same rows, same order) carries the new one's
    settings, and a step that only moves on reuses them."""
    runner = engine().core.runner
    hot = SamplingParams(temperature=0.7, max_tokens=4, stop_token_ids=[9])
    a, b, c = (Sequence(f"r{i}", 0, [1, 2, 3], p, 0) for i, p in enumerate((GREEDY, GREEDY, hot)))
    for i, s in enumerate((a, b, c)):
        s.block_ids = [i]
    three, zero = np.full(2, 3, np.int32), np.zeros(2, np.int32)
    first = runner.prepare(SchedulerOutput([a, b], three, zero, three, zero))
    second = runner.prepare(SchedulerOutput([c, b], three, zero, three, zero, finished=[a.seq_id]))
    one = three // 3
    decodes = [runner.prepare(SchedulerOutput([c, b], one, three + k, three + k + 1, zero)) for k in range(2)]
    assert first.rows.tolist() == second.rows.tolist() == decodes[1].rows.tolist()
    assert first.sampling.temperature[:2].tolist() == [0.0, 0.0]
    for batch in (second, *decodes):
        assert batch.sampling.temperature[:2].tolist() == pytest.approx([0.7, 0.0])
        assert batch.sampling.stop_ids[0, 0] == 9 and batch.sampling.stop_ids[1, 0] == -1
    assert [d.sampling.out_pos[:2].tolist() for d in decodes] == [[1, 1], [2, 2]]


def test_streaming_requests_get_one_token_per_output_and_loops_do_not_force_a_sync():
    """With num_scheduler_steps=8, a request whose output kind is "delta" (how the server streams)
    makes the decode loop give way: every core output carries one new token. Without one the loop
    runs, and the next step is dispatched while it is still in flight; tokens are the same."""
    eng = engine(num_scheduler_steps=8)
    core = eng.core
    dispatched_behind_loop = []
    dispatch = core.runner.dispatch

    def spy(batch):
        dispatched_behind_loop.append(bool(core.inflight) and core.inflight[-1].batch.sched.num_steps > 1)
        return dispatch(batch)

    core.runner.dispatch = spy
    ps = prompts([5, 9], seed=2)
    runs = {}
    for kind in ("delta", "cumulative"):
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, output_kind=kind)
        for i, p in enumerate(ps):
            core.add_request(eng.input_processor.process(f"{kind}{i}", p, params))
        sizes, tokens = [], {}
        while core.has_work():
            for out in core.step():
                sizes.append(len(out.new_token_ids))
                tokens.setdefault(out.request_id[-1], []).extend(out.new_token_ids)
        runs[kind] = sizes, tokens
    assert max(runs["delta"][0]) == 1 and max(runs["cumulative"][0]) > 1
    assert runs["delta"][1] == runs["cumulative"][1] and len(runs["delta"][1]["0"]) == 20
    assert any(dispatched_behind_loop)


def test_rows_of_requests_aborted_before_an_empty_step_are_freed():
    """A request aborted after its first step leaves the batch in a step that schedules nothing: its
    runner row is still freed, so more requests than the table's rows can pass through, one by one."""
    eng = engine(max_num_seqs=2)
    core = eng.core
    ps = prompts([6], seed=4)
    for i in range(3 * core.runner.slots.blocks.shape[0]):
        core.add_request(eng.input_processor.process(f"a{i}", ps[0], GREEDY))
        core.step()
        core.abort_requests([f"a{i}"])
        while core.has_work():
            core.step()
        core.step()  # nothing scheduled: the aborted row is freed here
    assert not core.runner.slots.slot_of
    assert len(core.runner.slots.free) == core.runner.slots.blocks.shape[0]
