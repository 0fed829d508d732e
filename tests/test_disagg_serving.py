"""Prefill/decode disaggregation end to end: a prefill server (kv_producer) and a decode server
(kv_consumer) behind the proxy answer concurrent greedy requests token for token as one colocated
server does, with prefix caching on; the decode server pulls the prompts' KV blocks (it does not
recompute them), and both pools and offers go back to empty. (Preemption: test_disagg_engine.py.)"""

from __future__ import annotations

import contextlib
import types
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from serve.kv_transfer.shm_transport import ShmHandle, release
from serve.scale.disagg_proxy import Proxy, build_proxy_app
from tests.server_helpers import MODEL_NAME, core_stats, eventually, metric, running_server, serve_in_thread

LONG = "the quick brown fox jumps over the lazy dog " * 3  # ~130 tokens
PROMPTS = [
    "Hello there",
    LONG + "and then",  # longer than a step's token budget: chunked on the prefill side
    LONG + "but why",  # shares LONG's blocks with the one before (prefix cache on both sides)
    "A short one about the sea",
    LONG[:70],
]
MAX_TOKENS = 12
pytestmark = pytest.mark.slow  # two servers' first compilations: minutes on a shared 2-core CPU


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The proxy, prefill and decode servers (one compilation cache); the prefill server also answers
    whole requests (those without kv_transfer_params), as the colocated reference."""
    cache = str(tmp_path_factory.mktemp("xla-cache"))
    common = dict(compilation_cache_dir=cache, max_num_batched_tokens=48)
    with contextlib.ExitStack() as stack:
        p_url, p_app = stack.enter_context(running_server(**common, kv_transfer_config={"kv_role": "kv_producer"}))
        d_url, d_app = stack.enter_context(running_server(**common, kv_transfer_config={"kv_role": "kv_consumer"}))
        app = build_proxy_app(Proxy([p_url], [d_url], prefill_timeout=600))  # first compilations: minutes
        app.state.server = types.SimpleNamespace(engine=types.SimpleNamespace(shutdown=lambda: None))
        proxy = stack.enter_context(serve_in_thread(app))
        yield types.SimpleNamespace(both=p_url, proxy=proxy, p_url=p_url, p_app=p_app, d_url=d_url, d_app=d_app)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)


def _texts(url: str, prompt: str, n: int, stream: bool) -> list[str]:
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, n=n, stream=stream)
    out = _client(url).completions.create(**kwargs)
    if not stream:
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    texts = [""] * n
    for chunk in out:
        for c in chunk.choices:
            texts[c.index] += c.text
    return texts


def _settled(app) -> bool:
    """Every KV block free again and no offer held."""
    s = core_stats(app)
    return s.num_free_blocks == s.num_blocks and s.num_running == s.num_waiting == 0 and s.kv_transfer.blocks_held == 0


def test_greedy_outputs_equal_colocated_under_load(servers):
    """Mixed prompts at once (streamed or not, n = 1 and 2) through the proxy; the decode side loads
    the prompts' blocks instead of computing them."""
    both, proxy, p_app, d_app = servers.both, servers.proxy, servers.p_app, servers.d_app
    cases = [(p, n, stream) for p in PROMPTS for n, stream in ((1, False), (2, True))]
    want = [_texts(both, p, n, stream) for p, n, stream in cases]
    loads_before = core_stats(d_app).kv_transfer.xfer_count["load"]
    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda case: _texts(proxy, *case), cases))
    assert got == want
    d = core_stats(d_app)
    assert d.kv_transfer.xfer_count["load"] - loads_before >= len(PROMPTS)  # pulled, not recomputed
    assert d.kv_transfer.num_failed_transfers == 0
    assert eventually(lambda: _settled(d_app) and _settled(p_app), timeout=30)
    p = core_stats(p_app).kv_transfer
    assert p.blocks_offered == p.blocks_pulled > 0 and p.blocks_expired == 0


def test_an_idle_prefill_engine_frees_a_pulled_offer_while_stats_are_polled(servers):
    """An idle prefill engine notices a pulled segment even when a client asks for its stats more often
    than the core's idle wake-up (the poll had been skipped on every wake by a message)."""
    body = dict(model=MODEL_NAME, prompt=LONG + "idle", max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = httpx.post(servers.p_url + "/v1/completions", json=body, timeout=600).json()["kv_transfer_params"]
    assert eventually(lambda: core_stats(servers.p_app).kv_transfer.blocks_held > 0)
    assert release(ShmHandle.from_params(params["handle"]))  # what a decode engine's pull leaves
    assert eventually(lambda: core_stats(servers.p_app).kv_transfer.blocks_held == 0, timeout=15)


def test_openai_client_streams_chat_through_proxy(servers):
    both, proxy = servers.both, servers.proxy
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": LONG}], max_tokens=8, temperature=0.0)
    want = _client(both).chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in _client(proxy).chat.completions.create(**kwargs, stream=True)
        if c.choices
    )
    assert streamed == want
    assert _client(proxy).chat.completions.create(**kwargs).choices[0].message.content == want


def test_transfer_metrics(servers):
    _texts(servers.proxy, LONG + "metrics", 1, False)
    p_url, d_url = servers.p_url, servers.d_url
    assert metric(p_url, "jaxinfra:kv_transfer_bytes_total", op="save", kv_role="kv_producer") > 0
    assert metric(d_url, "jaxinfra:kv_transfer_bytes_total", op="load", kv_role="kv_consumer") > 0
    assert metric(d_url, "jaxinfra:kv_transfer_xfer_time_seconds_count", op="load") > 0
    assert eventually(lambda: metric(p_url, "jaxinfra:kv_transfer_blocks_total", event="pulled") > 0)
