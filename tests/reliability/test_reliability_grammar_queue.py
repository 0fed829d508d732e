"""The core process's grammar queue without a server: structured requests join the engine core only
once their matchers are compiled (on worker threads); a pathological grammar is refused, and so is
one past the compile budget; aborting a waiting request drops it."""

import time

from serve.core.grammar_queue import GrammarQueue
from serve.sampling_params import SamplingParams, StructuredOutputsParams
from serve.types import EngineCoreRequest
from tests.serve_helpers import engine


def request(rid: str, regex: str, n: int = 1) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=4, n=n, structured_outputs=StructuredOutputsParams(regex=regex))
    return EngineCoreRequest(rid, [1, 2, 3], params, 0, time.monotonic())


def admit_all(queue: GrammarQueue, timeout: float = 60.0) -> list[tuple[str, str]]:
    refused, deadline = [], time.monotonic() + timeout
    while len(queue) and time.monotonic() < deadline:
        queue.wait(0.05)
        refused += queue.admit()
    return refused


def test_requests_join_the_core_when_their_grammar_is_ready():
    core = engine().core
    queue = GrammarQueue(core)
    queue.add(request("ok", "[a-z]+@x\\.com", n=2))
    queue.add(request("bad", "(a{1000}){1000}"))
    assert "ok" not in core.requests  # not before its matchers exist
    refused = admit_all(queue)
    assert [rid for rid, _ in refused] == ["bad"] and "structured_outputs: the grammar" in refused[0][1]
    assert [s.matcher is not None for s in core.requests["ok"].seqs] == [True, True]
    assert core.requests["ok"].seqs[0].matcher is not core.requests["ok"].seqs[1].matcher


def test_budget_and_abort():
    core = engine().core
    queue = GrammarQueue(core, budget_s=0.0)
    queue.add(request("late", "(a{1000}){1000}"))
    assert queue.admit() == [("late", "structured_outputs: the grammar did not compile within 0 s")]
    queue = GrammarQueue(core)
    queue.add(request("gone", "[0-9]+"))
    queue.abort(["gone"])
    assert not len(queue) and queue.admit() == [] and "gone" not in core.requests
