"""The disaggregation proxy against stand-in engines: the prefill/decode protocol (vLLM's
kv_transfer_params), the official openai client through it, least-outstanding balancing, a client
that leaves aborting both sides, a dead or stuck prefill engine answered with a bounded 503."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import types

import httpx
import openai
import pytest

from serve.scale.balancer import LeastOutstanding
from serve.scale.disagg_proxy import Proxy, build_proxy_app
from tests.kv_transfer.fake_engines import FakeEngine
from tests.server_helpers import serve_in_thread


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_proxy(proxy: Proxy):
    """`proxy` served on a loopback port (its URL), for a test that set its client or pools up itself."""
    app = build_proxy_app(proxy)
    app.state.server = types.SimpleNamespace(engine=types.SimpleNamespace(shutdown=lambda: None))
    with serve_in_thread(app) as url:
        yield url


@contextlib.contextmanager
def proxy_for(prefill: list[str], decode: list[str], **kwargs):
    with serve_proxy(Proxy(prefill, decode, **kwargs)) as url:
        yield url


def _wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def engines():
    prefill, decode = FakeEngine("prefill0"), FakeEngine("decode0", chunks=40, chunk_delay=0.02)
    with (
        serve_in_thread(prefill.app()) as p_url,
        serve_in_thread(decode.app()) as d_url,
        proxy_for([p_url], [d_url]) as url,
    ):
        yield prefill, decode, url


def test_openai_client_through_proxy(engines):
    prefill, decode, url = engines
    client = openai.OpenAI(base_url=url + "/v1", api_key="secret")
    out = client.completions.create(model="tiny", prompt="hi", max_tokens=7, extra_body={"min_tokens": 2})
    assert out.choices[0].text == "decode0<-prefill0"
    sent = prefill.bodies[-1]
    assert sent["max_tokens"] == 1 and "min_tokens" not in sent
    assert sent["kv_transfer_params"] == {"do_remote_decode": True}
    assert decode.bodies[-1]["max_tokens"] == 7 and decode.bodies[-1]["min_tokens"] == 2
    assert decode.bodies[-1]["kv_transfer_params"] == {"remote_engine": "prefill0", "remote_block_ids": [1, 2]}
    assert prefill.headers[-1]["authorization"] == decode.headers[-1]["authorization"] == "Bearer secret"

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5
    )
    assert chat.choices[0].message.content == "decode0<-prefill0"
    assert prefill.bodies[-1]["max_completion_tokens"] == 1 and decode.bodies[-1]["max_completion_tokens"] == 5

    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "decode0<-prefill0" + "".join(f" {i}" for i in range(1, 40))
    assert "stream" not in prefill.bodies[-1] and "stream_options" not in prefill.bodies[-1]
    assert decode.bodies[-1]["stream"] is True
    pieces = client.completions.create(model="tiny", prompt="hi", stream=True)
    assert "".join(c.choices[0].text for c in pieces).startswith("decode0<-prefill0 1 2")
    assert client.models.list().data[0].id == "tiny"


def test_client_disconnect_aborts_decode_stream(engines):
    _, decode, url = engines
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", url + "/v1/completions", json={"prompt": "hi", "stream": True}) as r,
    ):
        assert next(r.iter_lines()).startswith("data: ")
        n = len(decode.bodies) - 1
    assert _wait_for(lambda: n in decode.aborted)  # 40 chunks x 20 ms were left


def test_client_disconnect_during_prefill_aborts_it():
    prefill, decode = FakeEngine("prefill0", delay=5.0), FakeEngine("decode0")
    with (
        serve_in_thread(prefill.app()) as p_url,
        serve_in_thread(decode.app()) as d_url,
        proxy_for([p_url], [d_url]) as url,
    ):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=0.5)
        assert _wait_for(lambda: prefill.aborted == [0], timeout=4.0)
        assert decode.bodies == []


def test_dead_prefill_is_a_bounded_503_and_recovers():
    port = _free_port()
    prefill_url = f"http://127.0.0.1:{port}"
    decode = FakeEngine("decode0")
    with serve_in_thread(decode.app()) as d_url, proxy_for([prefill_url], [d_url]) as url:
        start = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert r.status_code == 503 and time.monotonic() - start < 5
        assert r.json()["error"]["code"] == "prefill_unavailable" and prefill_url in r.json()["error"]["message"]
        with serve_in_thread(FakeEngine("prefill0").app(), port=port):
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decode0<-prefill0"


def test_prefill_dying_as_the_proxy_connects_is_a_503():
    """A connection the engine resets right after connect (it was killed) makes anyio raise AttributeError,
    not an httpx error: still the OpenAI 503, the engine no longer counted as busy."""

    def reset(request: httpx.Request) -> httpx.Response:
        raise AttributeError("'NoneType' object has no attribute 'getpeername'")

    proxy = Proxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(reset))
    with serve_proxy(proxy) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "prefill_unavailable"
    assert "unreachable (AttributeError)" in r.json()["error"]["message"]
    assert proxy.status()["prefill"] == {"http://127.0.0.1:9": 0}


def test_stuck_prefill_times_out_and_other_prefill_takes_over():
    stuck, decode = FakeEngine("prefill-stuck", delay=30.0), FakeEngine("decode0")
    with serve_in_thread(stuck.app()) as s_url, serve_in_thread(decode.app()) as d_url:
        with proxy_for([s_url], [d_url], prefill_timeout=1.0) as url:
            start = time.monotonic()
            r = httpx.post(url + "/v1/chat/completions", json={"messages": []}, timeout=30)
            assert r.status_code == 503 and "timed out" in r.json()["error"]["message"]
            assert time.monotonic() - start < 4
        dead = f"http://127.0.0.1:{_free_port()}"
        live = FakeEngine("prefill1")
        with serve_in_thread(live.app()) as l_url, proxy_for([dead, l_url], [d_url]) as url:
            for _ in range(4):  # the unreachable one is passed over, whatever its turn
                r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
                assert r.json()["choices"][0]["text"] == "decode0<-prefill1"


def test_least_outstanding_balancing():
    pool = LeastOutstanding(["http://a/", "http://b"], "decode")
    assert pool.urls == ["http://a", "http://b"]
    assert {pool.ranked()[0] for _ in range(4)} == {"http://a", "http://b"}  # ties take turns
    pool.acquire("http://a")
    assert all(pool.ranked() == ["http://b", "http://a"] for _ in range(3))
    pool.acquire("http://b")
    pool.acquire("http://b")
    assert pool.ranked()[0] == "http://a"
    pool.release("http://b")
    pool.release("http://b")
    pool.release("http://a")
    assert pool.outstanding == {"http://a": 0, "http://b": 0}
    with pytest.raises(ValueError, match="--prefill needs at least one URL"):
        LeastOutstanding([], "prefill")


def test_bad_body_is_an_openai_400(engines):
    _, _, url = engines
    r = httpx.post(url + "/v1/completions", content=b"[1, 2]", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"] == "request body must be a JSON object"


@pytest.mark.slow
def test_jaxinfra_serve_role_proxy_command():
    """`python -m serve --role proxy` (what `jaxinfra serve` runs) as its own process."""
    prefill, decode = FakeEngine("prefill0"), FakeEngine("decode0")
    port = _free_port()
    with serve_in_thread(prefill.app()) as p_url, serve_in_thread(decode.app()) as d_url:
        cmd = [sys.executable, "-m", "serve", "--role", "proxy", "--prefill", p_url, "--decode", d_url]
        proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert _wait_for(lambda: _answers(f"http://127.0.0.1:{port}/health"), timeout=120), "no proxy"
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi"}, timeout=30)
            assert r.json()["choices"][0]["text"] == "decode0<-prefill0"
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    bad = subprocess.run([sys.executable, "-m", "serve", "--role", "proxy"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--prefill needs at least one URL" in bad.stderr


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False
