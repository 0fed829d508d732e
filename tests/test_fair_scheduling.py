"""The fair scheduling policy: weighted fair queueing between tenants in the scheduler (admission order
and preemption victim), checked against fcfs on the same workloads, and end to end through the HTTP
server where a tenant's backlog no longer delays another tenant's request."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from serve import EngineArgs, SamplingParams
from serve.core.kv_cache import BlockManager
from serve.core.layout import CoreLayout
from serve.core.scheduler import Scheduler
from serve.core.sequence import Sequence
from serve.engine.input_processor import InputProcessor
from serve.http.auth import key_digest
from serve.http.tenants import Tenant, load_keys_file
from tests.server_helpers import MODEL_NAME, metric, running_server

PARAMS = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)


def _seq(rid: str, tenant: str, prompt_len: int = 4, weight: float = 1.0, arrival: float = 0.0) -> Sequence:
    return Sequence(rid, 0, list(range(prompt_len)), PARAMS, 0, None, (0, arrival), tenant, weight)


def _step(sched: Scheduler, length: int) -> list[tuple[Sequence, int]]:
    """One step with every scheduled token computed; a sequence of `length` tokens leaves."""
    out = sched.schedule()
    for seq in out.seqs:
        if seq.num_pending:
            seq.num_pending = 0
            seq.tokens.append(5)
            if seq.num_tokens >= length:
                sched.remove(seq)
    return list(zip(out.seqs, out.num_new.tolist()))


def _admission_order(policy: str) -> list[str]:
    """Tenant a queues 6 requests; b queues one once a's first two run (2 rows): the admission order."""
    sched = Scheduler(BlockManager(64, 4), CoreLayout(2, 64, scheduling_policy=policy))
    for i in range(6):
        sched.add(_seq(f"a{i}", "a", arrival=i))
    order: list[str] = []
    for step in range(60):
        if step == 1:
            sched.add(_seq("b0", "b", arrival=10))
        order += [s.request_id for s, _ in _step(sched, 10) if s.request_id not in order]
    return order


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_late_tenant_is_admitted_before_another_tenants_backlog(policy):
    order = _admission_order(policy)
    assert sorted(order) == sorted([f"a{i}" for i in range(6)] + ["b0"])
    if policy == "fair":  # the first row that frees goes to b
        assert order.index("b0") == 2
    else:  # fcfs: b waits for all of a's backlog
        assert order.index("b0") == 6


def test_weights_split_the_engine_in_proportion():
    """Tenants of weight 3 and 1, both with deep backlogs of equal requests: the tokens each computes
    over a window follow the weights."""
    sched = Scheduler(BlockManager(256, 4), CoreLayout(4, 64, scheduling_policy="fair"))
    for i in range(60):
        sched.add(_seq(f"a{i}", "a", weight=3.0, arrival=i))
        sched.add(_seq(f"b{i}", "b", weight=1.0, arrival=i))
    done = {"a": 0, "b": 0}
    for _ in range(150):
        for seq, n in _step(sched, 12):
            done[seq.tenant] += n
    assert 2.4 <= done["a"] / done["b"] <= 3.6, done


def test_preemption_takes_the_most_served_tenants_newest_sequence():
    """Short of blocks, fcfs preempts the newest row (tenant b's only one); fair preempts the newest of
    tenant a, which has been served more since b joined."""
    victims = {}
    for policy in ("fcfs", "fair"):
        sched = Scheduler(BlockManager(5, 4), CoreLayout(4, 64, scheduling_policy=policy))
        a0, a1, b0 = _seq("a0", "a", 7), _seq("a1", "a", 7), _seq("b0", "b", 1)
        sched.add(a0)
        sched.add(a1)
        _step(sched, 100)  # a's two prompts, 2 blocks each
        sched.add(b0)
        _step(sched, 100)  # a decode their 8th tokens; b's one-token prompt takes the last block
        out = sched.schedule()  # a's rows each need a third block: none is free
        victims[policy] = [s.request_id for s in out.preempted]
        sched.bm.check_invariants([*sched.running, *sched.waiting])
    assert victims == {"fcfs": ["b0", "a1"], "fair": ["a1"]}


def test_one_tenant_under_fair_is_exactly_fcfs():
    """Random arrivals into a pool short of blocks (preemptions included): step for step the same."""
    runs = {}
    for policy in ("fcfs", "fair"):
        rng = random.Random(0)
        sched = Scheduler(BlockManager(12, 4), CoreLayout(3, 8, scheduling_policy=policy))
        steps = []
        for i in range(120):
            if rng.random() < 0.3:
                sched.add(_seq(f"r{i}", "", rng.randint(1, 14), arrival=i))
            out = _step(sched, 24)
            steps.append([(s.request_id, n) for s, n in out])
        runs[policy] = steps
        assert sched.num_preemptions > 0
    assert runs["fcfs"] == runs["fair"]


def test_an_idle_tenant_banks_no_credit():
    """Tenant a runs alone for long; then b arrives with a backlog as deep as a's. b does not take
    every row for as long as a ran: the admissions alternate."""
    sched = Scheduler(BlockManager(256, 4), CoreLayout(2, 64, scheduling_policy="fair"))
    for i in range(40):
        sched.add(_seq(f"a{i}", "a", arrival=i))
    for _ in range(60):
        _step(sched, 10)
    for i in range(20):
        sched.add(_seq(f"b{i}", "b", arrival=100 + i))
    admitted: list[str] = []
    while len(admitted) < 10:
        admitted += [s.tenant for s, n in _step(sched, 10) if n > 1]  # a prompt: a new admission
    assert 3 <= admitted.count("a") <= 7, admitted


@pytest.mark.parametrize("weight", [0, -1.0, 1e9, float("nan"), "2", True])
def test_a_bad_weight_is_a_value_error_naming_it(tmp_path, weight):
    with pytest.raises(ValueError, match="weight"):
        Tenant("a", weight=weight)
    path = tmp_path / "keys.yaml"
    path.write_text(f"tenants: {{a: {{weight: {weight!r}}}}}\nkeys: {{sk-aaaaaaaa: a}}")
    with pytest.raises(ValueError, match="weight"):
        load_keys_file(path)
    processor = InputProcessor(None, 64, 64)
    with pytest.raises(ValueError, match="weight"):
        processor.process("r", [1, 2], PARAMS, weight=weight)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineArgs(scheduling_policy="wfq")


def test_over_http_one_tenants_backlog_does_not_delay_another():
    """One row: tenant a queues three long completions, then b sends a short one. Under fair, b's
    finishes before a's third starts (under fcfs it would wait for all three)."""
    keys = {key_digest("sk-tenant-a"): Tenant("a"), key_digest("sk-tenant-b"): Tenant("b", weight=2.0)}
    with running_server(api_keys=keys, max_num_seqs=1, scheduling_policy="fair") as (url, _):
        finished: dict[str, float] = {}

        def complete(name: str, key: str, max_tokens: int) -> None:
            body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "ignore_eos": True}
            r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
            assert r.status_code == 200, r.text
            finished[name] = time.monotonic()

        # long enough that b's request reaches the server while two of a's still wait, on a loaded machine
        threads = [threading.Thread(target=complete, args=(f"a{i}", "sk-tenant-a", 200)) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while metric(url, "jaxinfra:num_requests_waiting", model_name=MODEL_NAME) < 2:  # one runs, two wait
            assert time.monotonic() < deadline
            time.sleep(0.01)
        threads.append(threading.Thread(target=complete, args=("b", "sk-tenant-b", 4)))
        threads[-1].start()
        for t in threads:
            t.join()
    assert finished["b"] < sorted(finished[f"a{i}"] for i in range(3))[-1]
