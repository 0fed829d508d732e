"""Prefix-aware routing: the router's choices, and a higher prefix-cache hit rate than round robin
on real engines (their own prefix-cache counters)."""

from __future__ import annotations

import pytest

from benchmarks.prefix_routing import hit_rate, replicas_of, workload
from serve.core.kv_cache import block_hash
from serve.scale.prefix_router import PrefixAwareRouter, RoundRobinRouter, prompt_block_hashes


def test_block_hashes_are_the_engine_chain():
    ids = list(range(40))
    hashes = prompt_block_hashes(ids, 16, "s", limit=8)
    assert len(hashes) == 2  # full blocks only
    assert hashes[1] == block_hash(block_hash(None, tuple(range(16)), "s"), tuple(range(16, 32)), "s")
    assert prompt_block_hashes(ids, 16, None, limit=1) == [block_hash(None, tuple(range(16)), None)]
    assert prompt_block_hashes(ids, 16, None, limit=8)[0] != hashes[0]  # a tenant's salt changes the chain


def test_same_prefix_same_replica_unless_it_is_overloaded():
    router = PrefixAwareRouter(3, block_size=4, max_num_seqs=4)
    a, b = [1] * 16, [2] * 16
    first = router.choose(a + [7])
    assert router.choose(a + [8]) == first  # 4 of 4 blocks cached there beats an idle replica
    other = router.choose(b)
    assert other != first  # nothing cached anywhere: the least loaded
    for _ in range(2):
        assert router.choose(a) == first
    assert router.in_flight[first] == 4
    spill = router.choose(a)
    assert spill not in (first, other)  # a full queue (max_num_seqs) outweighs the cache: the idle replica
    router.finished(first)
    assert router.choose(a) == spill  # it holds the prefix now too, and less is queued there


def test_round_robin_ignores_prompts():
    router = RoundRobinRouter(2)
    assert [router.choose([1] * 32) for _ in range(4)] == [0, 1, 0, 1]


@pytest.mark.slow
def test_prefix_aware_routing_beats_round_robin_on_engines():
    prompts = workload(prefixes=4, per_prefix=5, prefix_len=48)
    engines = replicas_of(2)
    rr = hit_rate(RoundRobinRouter(2), prompts, engines, wave=4)
    aware = hit_rate(PrefixAwareRouter(2, 16, max_num_seqs=16), prompts, engines, wave=4)
    print(f"prefix-cache hit rate: round robin {rr['hit_rate']:.3f}, prefix-aware {aware['hit_rate']:.3f}")
    assert rr["queries"] == aware["queries"]
    assert aware["hit_rate"] > rr["hit_rate"]
