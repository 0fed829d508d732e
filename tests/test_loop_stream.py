"""A decode loop's tokens stream one by one as the loop makes them (serve.core.loop_stream): in order,
never ahead of an earlier step's results, never for rows that finished, never twice; and an engine
core driven as its process drives it gives streams the same tokens as single steps, one per output."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serve import SamplingParams
from serve.core.engine_core import EngineCore
from serve.core.loop_stream import LoopTokenStream
from serve.core.pipe_tap import TapPipe
from serve.types import EngineCoreOutput, EngineCoreOutputs
from tests.serve_helpers import engine, model, prompts


def out(rid: str, tokens: list[int], finish: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(rid, 0, tokens, finish_reason=finish)


def said(msgs: list[EngineCoreOutputs]) -> list[list[tuple[str, list[int], str | None]]]:
    return [[(o.request_id, o.new_token_ids, o.finish_reason) for o in m.outputs] for m in msgs]


def test_loop_tokens_wait_for_earlier_results_and_skip_finished_rows():
    msgs: list[EngineCoreOutputs] = []
    stream = LoopTokenStream(msgs.append)
    stream.register(0, None)  # a step with a prompt
    # a loop dispatched behind it: a ends by length at its 3rd token, b runs on, row 3 makes a first token
    stream.register(1, [("a", 0, 3), ("b", 0, 0), None])
    stream.tap(np.array([1, 0, 11, 21, 99, 0, 0, 0]))  # before step 0's results went out: held
    stream.tap(np.array([1, 0, 11, 21, 99, 0, 0, 0]))  # the same iteration from a second device: dropped
    stream.results(EngineCoreOutputs(outputs=[out("a", [10]), out("b", [20], "stop")]), 0)
    stream.tap(np.array([1, 1, 12, 22, 98, 0, 0, 0]))
    stream.tap(np.array([1, 2, 13, -1, 97, 0, 0, 0]))  # a's last; -1: b's row has stopped on the device
    stream.results(EngineCoreOutputs(outputs=[out("a", [11, 12, 13], "length"), out("c", [99, 98, 97])]), 1)
    stream.close()
    assert said(msgs) == [
        [("a", [10], None), ("b", [20], "stop")],
        [("a", [11], None)],  # b finished in step 0: the loop's tokens for it are not its own
        [("a", [12], None)],
        [("a", [13], "length")],  # the stream ends with its last token
        [("c", [99, 98, 97], None)],  # streamed tokens and finish removed from the results
    ]


def test_stop_codes_finish_streams_as_the_host_would():
    """Stop code 1 (EOS) finishes with no stop reason, 2 (a stop id) with the token as the reason."""
    msgs: list[EngineCoreOutputs] = []
    stream = LoopTokenStream(msgs.append)
    stream.register(0, [("e", 0, 0), ("s", 0, 0), ("x", 0, 0)])
    stream.tap(np.array([0, 0, 5, 6, 7, 0, 0, 0]))
    stream.tap(np.array([0, 1, 2, 9, 8, 1, 2, 0]))
    stream.results(EngineCoreOutputs(outputs=[out("e", [5, 2], "stop"), out("s", [6, 9], "stop"), out("x", [7, 8])]), 0)
    stream.close()
    stop_reasons = [o.stop_reason for o in msgs[1].outputs]
    assert said(msgs) == [
        [("e", [5], None), ("s", [6], None), ("x", [7], None)],
        [("e", [2], "stop"), ("s", [9], "stop"), ("x", [8], None)],
        [],  # the results had nothing new to say (a real one still carries the stats)
    ]
    assert stop_reasons == [None, 9, None]


def test_results_of_several_steps_at_once_keep_their_held_tokens():
    """A step that had to wait for every earlier result (a sync) sends two steps' results together:
    the tokens held for the second are in them, and are not streamed after."""
    msgs: list[EngineCoreOutputs] = []
    stream = LoopTokenStream(msgs.append)
    stream.register(0, None)
    stream.register(1, [("a", 0, 0)])
    stream.tap(np.array([1, 0, 5, 0]))
    stream.tap(np.array([1, 1, 6, 0]))
    stream.register(2, [("a", 0, 1)])
    stream.results(EngineCoreOutputs(outputs=[out("a", [4, 5, 6])]), 1)
    stream.tap(np.array([2, 0, 7, 0]))
    stream.send(EngineCoreOutputs())  # an idle message in between keeps its place
    stream.results(EngineCoreOutputs(outputs=[out("a", [7], "length")]), 2)
    stream.close()
    assert said(msgs) == [[("a", [4, 5, 6], None)], [("a", [7], "length")], [], []]


def test_a_loop_behind_a_fully_streamed_loop_streams_before_its_results():
    """At a loop boundary the next loop's tokens go out at once when the loop still out streamed every
    row (its rows that ended are skipped); behind a loop with a row it did not stream, they wait."""
    msgs: list[EngineCoreOutputs] = []
    stream = LoopTokenStream(msgs.append)
    stream.register(0, [("a", 0, 0), ("b", 0, 0)])
    stream.register(1, [("a", 0, 0), ("b", 0, 0)])
    stream.tap(np.array([0, 0, 5, 6, 0, 1]))  # b ends by EOS in loop 0
    stream.tap(np.array([1, 0, 7, 8, 0, 0]))  # loop 1 before loop 0's results: a streams, b is not b's
    stream.register(2, [("a", 0, 0), None])  # a row loop 2 does not stream ...
    stream.register(3, [("a", 0, 0)])
    stream.results(EngineCoreOutputs(outputs=[out("a", [5]), out("b", [6], "stop")]), 0)
    stream.tap(np.array([2, 0, 9, 4, 0, 0]))
    stream.tap(np.array([3, 0, 10, 0]))  # ... so loop 3 waits for loop 2's results
    stream.results(EngineCoreOutputs(outputs=[out("a", [7])]), 1)
    stream.results(EngineCoreOutputs(outputs=[out("a", [9]), out("c", [4])]), 2)
    stream.results(EngineCoreOutputs(outputs=[out("a", [10], "length")]), 3)
    stream.close()
    assert said(msgs) == [
        [("a", [5], None), ("b", [6], "stop")],
        [("a", [7], None)],  # before loop 0's results; b's row is no longer b's
        [],  # loop 0's results: everything in them was streamed
        [("a", [9], None)],  # loop 2 streams behind loop 1 (fully streamed) too
        [],  # loop 1's results
        [("c", [4], None)],  # loop 2's results: its row that did not stream
        [("a", [10], None)],  # loop 3's token, held until loop 2's results went out
        [("a", [], "length")],
    ]


@pytest.mark.parametrize("native", [True, False], ids=["ffi", "io_callback"])
def test_the_tap_runs_every_iteration_and_leaves_the_loop_free_of_effects(native, monkeypatch):
    """The receipt carried to the loop's outputs keeps each call; no effect in the traced loop, so its
    jitted function keeps JAX's C++ dispatch (an effect sends every call through Python's). Each call
    is one message on the pipe, in order with the markers written around the loop, by the C++ call on
    one CPU device and by Python (an io_callback) where that library is missing."""
    pipe = TapPipe()
    assert (pipe._lib is not None) or not native, "the C++ tap did not build here"
    if not native:
        monkeypatch.setattr(pipe, "_lib", None)
    tap = pipe.device_tap()

    def loop(x):
        body = lambda c: (c[0] + 1, tap(jnp.stack([c[0], x + c[0], -c[0]])))
        return jax.lax.while_loop(lambda c: c[0] < 3, body, (jnp.int32(0), jnp.zeros((1,), jnp.int32)))

    if native:
        assert not jax.make_jaxpr(loop)(5).effects
        assert "jaxinfra_pipe_tap" in jax.jit(loop).lower(5).as_text()
    pipe.mark()
    jax.block_until_ready(jax.jit(loop)(5))
    pipe.mark()
    got = [pipe.read() for _ in range(5)]
    pipe.close()
    assert got[0] is None and got[-1] is None
    assert [v.tolist() for v in got[1:-1]] == [[0, 5, 0], [1, 6, -1], [2, 7, -2]]


def test_streamed_decode_loops_give_single_step_tokens_one_per_output():
    """Driven as the core process drives it: streams (output kind "delta") run 8-step loops now, and
    every output carries one token; tokens, finish reasons and stop ids are single steps' own.
    Requests arrive while others run, stop on a stop id, sample two sequences, ask for logprobs (a
    whole answer's logprobs run in the loop unstreamed: the tap carries none, and none may be lost)."""
    ps = prompts([5, 9, 30, 12, 7, 11], seed=3)
    base = SamplingParams(temperature=0.0, max_tokens=30, output_kind="delta")
    singles = engine(num_scheduler_steps=1)
    singles.core.add_request(singles.input_processor.process("probe", ps[2], base))  # the stop id: a token
    made: list[int] = []  # the "stop" prompt makes after a few steps
    while singles.core.has_work():
        for o in singles.core.step():
            made += o.new_token_ids
    params = {
        "plain": base,
        "n2": SamplingParams(temperature=0.0, max_tokens=20, n=2),
        "stop": dataclasses.replace(base, stop_token_ids=[made[6]]),
        "logprobs": dataclasses.replace(base, max_tokens=6, logprobs=2),
        "late": dataclasses.replace(base, max_tokens=17),
        "whole_logprobs": SamplingParams(temperature=0.0, max_tokens=20, logprobs=1),
    }

    def requests(eng):
        return [eng.input_processor.process(rid, p, params[rid]) for rid, p in zip(params, ps)]

    reference: dict[tuple[str, int], list[int]] = {}
    finish: dict[tuple[str, int], str] = {}
    for msg in _drive(singles.core, requests(singles), None):
        for o in msg.outputs:
            reference.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
            if o.finish_reason:
                finish[(o.request_id, o.index)] = o.finish_reason

    looped = engine(num_scheduler_steps=8)
    msgs: list[EngineCoreOutputs] = []
    stream = LoopTokenStream(msgs.append)
    looped.core = EngineCore(model(), looped.args, looped.tokenizer.eos_token_ids, looped.tokenizer, stream=stream)
    loops = []
    dispatch = looped.core.runner.dispatch
    looped.core.runner.dispatch = lambda batch: loops.append(batch.sched.num_steps) or dispatch(batch)
    _drive(looped.core, requests(looped), stream)
    got: dict[tuple[str, int], list[int]] = {}
    got_finish: dict[tuple[str, int], str] = {}
    num_logprobs = 0
    for msg in msgs:
        for o in msg.outputs:
            key = (o.request_id, o.index)
            assert key not in got_finish, f"{key} got an output after it finished"
            got.setdefault(key, []).extend(o.new_token_ids)
            if o.finish_reason:
                got_finish[key] = o.finish_reason
            if o.request_id == "whole_logprobs":
                num_logprobs += len(o.new_logprobs or [])
                continue
            assert len(o.new_token_ids) <= 1, (key, o.new_token_ids)
            assert o.new_token_ids or not o.finish_reason, f"{key}'s finish came after its last token"
    assert got == reference and got_finish == finish
    assert num_logprobs == len(got[("whole_logprobs", 0)]) == 20
    assert finish[("stop", 0)] == "stop" and reference[("stop", 0)][-1] == made[6]
    assert max(loops) == 8  # streams looped


def _drive(core, requests, stream: LoopTokenStream | None) -> list[EngineCoreOutputs]:
    """The core process's loop: one request joins per step at first, the last one later."""
    sent: list[EngineCoreOutputs] = []
    arrivals = {0: requests[:1], 1: requests[1:2], 2: requests[2:4], 12: requests[4:]}
    step = 0
    while core.has_work() or any(s >= step for s in arrivals):
        for req in arrivals.get(step, []):
            core.add_request(req)
        msg = EngineCoreOutputs(outputs=core.step() if core.has_work() else [])
        if stream is not None:
            stream.results(msg, core.applied_step)
        sent.append(msg)
        step += 1
    if stream is not None:
        stream.close()
    return sent
