"""The shared-memory KV connector driven through its scheduler and worker hooks as an engine would:
a prefill engine saves and offers a prompt's blocks, a decode engine with part of the prompt in its
prefix cache loads the rest bitwise; a wrong prompt is not loaded; an expired offer is a failed load;
an offer the decode engine will not load is freed at once."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import numpy as np
import pytest

from pallas_kernels import PagedKVCache
from serve.core.step_data import SchedulerOutput
from serve.kv_transfer.base import ALL_LAYERS
from serve.kv_transfer.shm_connector import SharedMemoryConnector
from serve.kv_transfer.shm_transport import release, segment_exists
from tests.kv_transfer.pools import blocks_of, random_pool

PROMPT = list(range(100, 110))  # 10 tokens: 3 blocks of 4


@dataclasses.dataclass
class Req:
    request_id: str
    tokens: list[int]
    block_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    prompt_len: int = 0

    def __post_init__(self) -> None:
        self.prompt_len = len(self.tokens)


@dataclasses.dataclass
class Holder:
    kv_cache: PagedKVCache


def prefill(conn: SharedMemoryConnector, pool: PagedKVCache, request_id: str) -> dict[str, Any]:
    """One prefill engine step computing the whole prompt, then the request finishing; its kv_transfer_params."""
    req = Req(request_id, PROMPT, [5, 2, 7], {"do_remote_decode": True})
    assert conn.get_num_new_matched_tokens(req, 0) == 0
    n = np.array([10])
    meta = conn.build_connector_meta(SchedulerOutput([req], n, np.array([0]), n, np.array([0])))
    assert [s.block_ids for s in meta.saves] == [[5, 2, 7]]
    conn.save_kv_layer(ALL_LAYERS, pool, meta)
    delay_free, params = conn.request_finished(req, req.block_ids)
    assert not delay_free and params is not None
    return json.loads(json.dumps(params))  # as it crosses the proxy


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_prefill_offers_and_decode_loads_missing_blocks(kind):
    source = random_pool(kind, 0)
    p_conn, d_conn = SharedMemoryConnector(block_size=4), SharedMemoryConnector(block_size=4)
    params = prefill(p_conn, source, "r1")
    assert len(p_conn.offers) == 1 and p_conn.offers.blocks_offered == 3

    holder = Holder(random_pool(kind, 1))
    d_conn.register_kv_caches(holder)
    untouched = blocks_of(holder.kv_cache, [0, 1, 2, 4, 5, 7])
    req = Req("r1", PROMPT, [], params)
    assert d_conn.get_num_new_matched_tokens(req, 4) == 5  # block 0 cached locally; the last token recomputed
    d_conn.update_state_after_alloc(req, [1, 3, 6], 5)
    meta = d_conn.build_connector_meta(SchedulerOutput([], *(np.zeros(0, int),) * 4))
    d_conn.start_load_kv(meta)
    d_conn.wait_for_layer_load(ALL_LAYERS)
    assert d_conn.get_finished() == (set(), {"r1"}) and d_conn.get_failed_loads() == set()
    expected, got = blocks_of(source, [2, 7]), blocks_of(holder.kv_cache, [3, 6])
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])
        np.testing.assert_array_equal(blocks_of(holder.kv_cache, [0, 1, 2, 4, 5, 7])[name], untouched[name])
    stats = d_conn.get_kv_connector_stats()
    assert stats.xfer_count["load"] == 1 and stats.bytes["load"] == sum(a.nbytes for a in got.values())

    p_conn.get_finished()  # the segment is gone: pulled
    assert len(p_conn.offers) == 0 and (p_conn.offers.blocks_pulled, p_conn.offers.blocks_expired) == (3, 0)


def test_other_prompt_is_not_loaded_and_expired_offer_is_recomputed():
    p_conn = SharedMemoryConnector(block_size=4, offer_timeout_s=0.05)
    params = prefill(p_conn, random_pool("bf16", 0), "r2")
    d_conn = SharedMemoryConnector(block_size=4)
    d_conn.register_kv_caches(Holder(random_pool("bf16", 1)))
    assert d_conn.get_num_new_matched_tokens(Req("x", [*PROMPT[:-1], 1], [], params), 0) == 0
    assert d_conn.get_num_new_matched_tokens(Req("y", PROMPT, [], {"handle": 3}), 0) == 0

    req = Req("r2", PROMPT, [], params)
    assert d_conn.get_num_new_matched_tokens(req, 0) == 9
    d_conn.update_state_after_alloc(req, [0, 1, 2], 9)
    time.sleep(0.1)
    p_conn.get_finished()  # nobody pulled in time: unlinked
    assert not segment_exists(params["handle"]["segment"])
    assert (p_conn.offers.blocks_pulled, p_conn.offers.blocks_expired) == (0, 3)
    d_conn.start_load_kv(d_conn.build_connector_meta(SchedulerOutput([], *(np.zeros(0, int),) * 4)))
    assert d_conn.get_finished() == (set(), set()) and d_conn.get_failed_loads() == {"r2"}
    assert d_conn.get_kv_connector_stats().num_failed_transfers == 1


def test_offer_the_decode_engine_will_not_load_is_freed_at_once():
    """A decode engine whose prefix cache holds the whole prompt, or whose request leaves before its
    load, unlinks the offer then (the prefill engine counts it pulled); another prompt's offer is kept."""
    p_conn = SharedMemoryConnector(block_size=4)
    d_conn = SharedMemoryConnector(block_size=4)
    cached, aborted = prefill(p_conn, random_pool("bf16", 0), "r8"), prefill(p_conn, random_pool("bf16", 0), "r9")
    req = Req("r8", PROMPT, [], cached)
    assert d_conn.get_num_new_matched_tokens(req, 9) == 0 and req.kv_transfer_params is None
    assert not segment_exists(cached["handle"]["segment"])
    d_conn.request_finished(Req("x", [*PROMPT[:-1], 1], [], aborted), [])  # not its prompt: not its offer
    assert segment_exists(aborted["handle"]["segment"])
    d_conn.request_finished(Req("r9", PROMPT, [], aborted), [])
    assert not segment_exists(aborted["handle"]["segment"])
    p_conn.get_finished()
    assert len(p_conn.offers) == 0 and (p_conn.offers.blocks_pulled, p_conn.offers.blocks_expired) == (6, 0)


def test_transfer_counters_on_metrics():
    """A prefill connector's save and offer, a decode connector's load, as /metrics renders them."""
    from prometheus_client.parser import text_string_to_metric_families

    from serve.http.metrics import ServerMetrics
    from serve.types import SchedulerStats

    p_conn, d_conn = SharedMemoryConnector(4, role="kv_producer"), SharedMemoryConnector(4, role="kv_consumer")
    params = prefill(p_conn, random_pool("int8", 0), "r3")
    d_conn.register_kv_caches(Holder(random_pool("int8", 1)))
    req = Req("r3", PROMPT, [], params)
    d_conn.update_state_after_alloc(req, [0, 1, 2], d_conn.get_num_new_matched_tokens(req, 0))
    d_conn.start_load_kv(d_conn.build_connector_meta(SchedulerOutput([], *(np.zeros(0, int),) * 4)))
    p_conn.get_finished()
    samples = {}
    for conn in (p_conn, d_conn):
        metrics = ServerMetrics("tiny")
        metrics.observe([], SchedulerStats(0, 1, 0.0, 0, 0, 0, 8, 8, 0, kv_transfer=conn.get_kv_connector_stats()))
        for family in text_string_to_metric_families(metrics.render().decode()):
            for s in family.samples:
                key = (s.name, s.labels.get("kv_role"), s.labels.get("op") or s.labels.get("event"))
                samples[key] = s.value
    nbytes = samples[("jaxinfra:kv_transfer_bytes_total", "kv_producer", "save")]
    assert nbytes > 0 and samples[("jaxinfra:kv_transfer_bytes_total", "kv_consumer", "load")] == nbytes
    assert samples[("jaxinfra:kv_transfer_xfer_time_seconds_count", "kv_consumer", "load")] == 1
    assert samples[("jaxinfra:kv_transfer_blocks_total", "kv_producer", "offered")] == 3
    assert samples[("jaxinfra:kv_transfer_blocks_total", "kv_producer", "pulled")] == 3


def test_prompt_saved_again_after_preemption_unlinks_the_first_copy():
    conn, pool = SharedMemoryConnector(block_size=4), random_pool("bf16", 0)
    req = Req("r4", PROMPT, [5, 2, 7], {"do_remote_decode": True})
    n = np.array([10])
    segments = []
    for _ in range(2):  # computed, preempted, computed again
        conn.get_num_new_matched_tokens(req, 0)
        conn.save_kv_layer(ALL_LAYERS, pool, conn.build_connector_meta(SchedulerOutput([req], n, n * 0, n, n * 0)))
        segments.append(conn.saved["r4"].handle.segment)
    _, params = conn.request_finished(req, req.block_ids)
    assert params is not None and params["handle"]["segment"] == segments[1]
    assert not segment_exists(segments[0]) and segment_exists(segments[1])
    assert release(conn.offers.offers["r4"].payload)  # cleanup: nobody pulls it here


def test_closing_engine_unlinks_its_offers():
    """A prefill engine that exits (atexit) leaves no segment behind, offered or only saved."""
    conn = SharedMemoryConnector(block_size=4)
    offered = prefill(conn, random_pool("bf16", 0), "r5")["handle"]["segment"]
    saved = prefill(conn, random_pool("bf16", 0), "r6")["handle"]["segment"]
    req = Req("r7", PROMPT, [5, 2, 7], {"do_remote_decode": True})
    conn.get_num_new_matched_tokens(req, 0)
    n = np.array([10])
    conn.save_kv_layer(
        ALL_LAYERS, random_pool("bf16", 0), conn.build_connector_meta(SchedulerOutput([req], n, n * 0, n, n * 0))
    )
    unfinished = conn.saved["r7"].handle.segment
    conn.close()
    assert not any(segment_exists(s) for s in (offered, saved, unfinished))
    assert len(conn.offers) == 0 and conn.offers.blocks_expired == 6
