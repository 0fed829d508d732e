"""Disaggregation inside the engine core, without HTTP: a kv_producer core computes prompts and offers
their blocks, a kv_consumer core admits the requests with those blocks loaded (its local prefix cache
hit first) and decodes them, under preemption, token for token as a colocated core does; a transfer
that fails is recomputed; offers nobody pulls expire; every pool goes back to full."""

from __future__ import annotations

import time

import pytest

from serve import EngineArgs, SamplingParams
from serve.core.engine_core import EngineCore
from serve.kv_transfer.shm_transport import ShmHandle, release, segment_exists
from serve.types import EngineCoreRequest
from tests.serve_helpers import ENGINE_DEFAULTS, model, prompts

PROMPTS = prompts([100, 110, 120, 90, 80, 15], seed=3)
PROMPTS.append(PROMPTS[0][:64] + [7, 8, 9])  # its first blocks are in both cores' prefix caches by then


def _core(role: str) -> EngineCore:
    """Both cores share every compiled step shape (same pool, same budget)."""
    return EngineCore(model(), EngineArgs(**ENGINE_DEFAULTS, kv_transfer_config={"kv_role": role}))


def _requests(max_tokens: int, n: int, params: list[dict | None]) -> list[EngineCoreRequest]:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)
    return [
        EngineCoreRequest(f"r{i}", p, sampling, 0, 0.0, kv_transfer_params=kv)
        for i, (p, kv) in enumerate(zip(PROMPTS, params))
    ]


def _run(core: EngineCore, requests: list[EngineCoreRequest]) -> tuple[dict, dict]:
    """Tokens by (request, sequence) and kv_transfer_params by request, the core idle and checked after."""
    for r in requests:
        core.add_request(r)
    tokens: dict[tuple[str, int], list[int]] = {}
    offered: dict[str, dict] = {}
    while core.has_work():
        for out in core.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            if out.kv_transfer_params is not None:
                offered[out.request_id] = out.kv_transfer_params
    core.check_invariants()  # no request: every block free
    return tokens, offered


pytestmark = pytest.mark.slow  # two engines' step compilations under preemption: minutes on a shared 2-core CPU


@pytest.fixture(scope="module")
def cores():
    return _core("kv_producer"), _core("kv_consumer")


def test_decode_core_with_pulled_blocks_equals_colocated(cores):
    prefill, decode = cores
    want, _ = _run(prefill, _requests(10, 2, [None] * len(PROMPTS)))  # colocated: no kv_transfer_params

    _, offered = _run(prefill, _requests(1, 1, [{"do_remote_decode": True}] * len(PROMPTS)))
    assert sorted(offered) == sorted(f"r{i}" for i in range(len(PROMPTS)))
    release(ShmHandle.from_params(offered["r2"]["handle"]))  # this transfer fails: the decode core recomputes

    stats = decode.kv_transfer.connector.get_kv_connector_stats()
    loads, preemptions = stats.xfer_count["load"], decode.scheduler.num_preemptions
    got, _ = _run(decode, _requests(10, 2, [offered[f"r{i}"] for i in range(len(PROMPTS))]))
    assert got == want
    assert stats.xfer_count["load"] - loads == len(PROMPTS) - 1 and stats.num_failed_transfers == 1
    assert decode.scheduler.num_preemptions > preemptions

    prefill.poll_kv_transfers()  # the pulled segments are gone: their offers are done
    p_stats = prefill.kv_transfer.connector.get_kv_connector_stats()
    assert p_stats.blocks_held == 0 and p_stats.blocks_pulled + p_stats.blocks_expired == p_stats.blocks_offered


def test_offer_nobody_pulls_expires(cores):
    prefill, _ = cores
    offers = prefill.kv_transfer.connector.offers
    offers.timeout_s, timeout = 0.2, offers.timeout_s
    try:
        _, offered = _run(prefill, _requests(1, 1, [{"do_remote_decode": True}])[:1])
    finally:
        offers.timeout_s = timeout
    segment = offered["r0"]["handle"]["segment"]
    expired = prefill.kv_transfer.connector.get_kv_connector_stats().blocks_expired
    assert segment_exists(segment)
    time.sleep(0.3)
    prefill.poll_kv_transfers()
    stats = prefill.kv_transfer.connector.get_kv_connector_stats()
    assert not segment_exists(segment) and stats.blocks_expired - expired == 13 and stats.blocks_held == 0
