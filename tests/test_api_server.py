"""The HTTP server over real loopback HTTP, driven by the official `openai` client and raw httpx: what
tokens, streams and aborts do on a real core; validation, keys and admission on the fake one
(tests/fake_engine.py), where no model runs."""

import asyncio

import httpx
import openai
import pytest

from tests.fake_engine import fake_server
from tests.server_helpers import MODEL_NAME, call, core_stats, eventually, metric, running_server


@pytest.fixture(scope="module")
def server():
    with running_server(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def protocol_server():
    """The same layout over the fake core: for what the frontend alone decides."""
    with fake_server(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server[0]}/health").status_code == 200


@pytest.mark.slow
def test_completion_and_streaming_agree(client):
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


@pytest.mark.slow
def test_chat_and_chat_streaming_agree(client):
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi there"}], max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant"
    deltas = [
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True) if c.choices
    ]
    assert "".join(deltas) == full.choices[0].message.content
    assert full.usage.completion_tokens == 10


@pytest.mark.slow
def test_n_stop_and_logprobs(client):
    r = client.completions.create(
        model=MODEL_NAME, prompt=[1, 2, 3, 4], max_tokens=8, n=2, temperature=1.0, seed=3, logprobs=2
    )
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 16
    assert all(len(c.logprobs.token_logprobs) == 8 for c in r.choices)
    free = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=12, temperature=0).choices[0].text
    stop = next(ch for ch in free[1:] if ch != "\ufffd")
    cut = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == free[: free.index(stop)] and cut.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
    )
    assert len(chat.choices[0].logprobs.content) == 3


def _post(url, path, body, **kw):
    return httpx.post(f"{url}{path}", json=body, timeout=30, **kw)


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"model": MODEL_NAME, "prompt": 3}, 400, "prompt"),
        ({"model": MODEL_NAME, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
        ({"model": MODEL_NAME, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL_NAME, "prompt": "x", "best_of": 3}, 400, "best_of"),
        ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL_NAME, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"model": MODEL_NAME, "prompt": "x", "priority": 1}, 400, "priority"),
        ({"model": MODEL_NAME, "prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, 400, "guided_choice"),
        ({"model": MODEL_NAME, "prompt": "x", "guided_regex": "(("}, 400, None),
        ({"model": MODEL_NAME, "prompt": "x", "guided_json": "{not json"}, 400, "guided_json"),
        ({"model": MODEL_NAME, "prompt": "x", "functions": [{"name": "f"}]}, 400, "functions"),
        ({"model": MODEL_NAME, "prompt": list(range(200))}, 400, "prompt"),
        ({"model": MODEL_NAME, "prompt": [1, 999999]}, 400, "prompt"),
        ({"model": MODEL_NAME}, 400, "prompt"),
    ],
)
def test_bad_completion_requests(protocol_server, body, status, param):
    r = _post(protocol_server[0], "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"], err


def test_bad_chat_requests_and_malformed_json(protocol_server):
    url = protocol_server[0]
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = _post(url, "/v1/chat/completions", {"model": MODEL_NAME, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = _post(url, "/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400
    r = _post(
        url, "/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "n": 0}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert httpx.get(f"{url}/health").status_code == 200  # the engine survived all of it


@pytest.mark.slow
def test_metrics_parse_and_add_up(server, client):
    url = server[0]
    names = (
        "jaxinfra:prompt_tokens_total",
        "jaxinfra:generation_tokens_total",
        "jaxinfra:time_to_first_token_seconds_count",
        "jaxinfra:e2e_request_latency_seconds_count",
    )
    before = {k: metric(url, k) for k in names}
    lengths = metric(url, "jaxinfra:request_success_total", finished_reason="length")
    usage = [
        client.completions.create(model=MODEL_NAME, prompt=[5] * (3 + i), max_tokens=4 + i, temperature=0).usage
        for i in range(3)
    ]
    assert metric(url, names[0]) - before[names[0]] == sum(u.prompt_tokens for u in usage)
    assert metric(url, names[1]) - before[names[1]] == sum(u.completion_tokens for u in usage)
    assert metric(url, names[2]) - before[names[2]] == 3 and metric(url, names[3]) - before[names[3]] == 3
    assert metric(url, "jaxinfra:request_success_total", finished_reason="length") - lengths == 3
    assert eventually(
        lambda: metric(url, "jaxinfra:num_requests_running") == 0 and metric(url, "jaxinfra:kv_cache_usage_perc") == 0
    )


@pytest.mark.slow
def test_disconnect_aborts_and_frees_blocks():
    with running_server(max_model_len=2048, max_num_seqs=2, max_num_batched_tokens=64, num_gpu_blocks_override=300) as (
        url,
        app,
    ):
        body = {
            "model": MODEL_NAME,
            "prompt": "tell me a long story",
            "max_tokens": 2000,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()  # not closed until the `with` ends (closing it would disconnect)
            for _ in range(4):
                next(lines)
            stats = core_stats(app)
            assert stats.num_running == 1 and stats.num_free_blocks < 300
        assert eventually(lambda: core_stats(app).num_free_blocks == 300)
        assert core_stats(app).num_running == core_stats(app).num_waiting == 0
        assert eventually(lambda: metric(url, "jaxinfra:request_success_total", finished_reason="abort") == 1)
        assert metric(url, "jaxinfra:generation_tokens_total") < 2000


def test_api_key():
    with fake_server(api_key="s3cret", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16) as (url, _):
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
        assert _post(url, "/v1/completions", body).status_code == 401
        r = _post(url, "/v1/completions", body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret").completions.create(**body)
        assert ok.usage.completion_tokens == 2
        # current vLLM: every route but /health, /metrics, /version, /ping needs it; any case of
        # "Bearer", or an x-api-key header
        assert _post(url, "/tokenize", {"prompt": "x"}).status_code == 401
        assert httpx.get(f"{url}/status").status_code == httpx.get(f"{url}/dashboard").status_code == 401
        for headers in (
            {"Authorization": "bearer s3cret"},
            {"authorization": "BEARER s3cret"},
            {"x-api-key": "s3cret"},
        ):
            assert _post(url, "/tokenize", {"prompt": "x"}, headers=headers).status_code == 200, headers
        assert httpx.get(f"{url}/metrics").status_code == httpx.get(f"{url}/version").status_code == 200


def test_overload_gets_429_counting_sequences():
    """Capacity is max_num_seqs + max_queue sequences (prompts x n), not HTTP calls."""
    with fake_server(
        max_queue=1, max_model_len=512, max_num_seqs=2, max_num_batched_tokens=16, num_gpu_blocks_override=150
    ) as (url, app):
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        state = app.state.server

        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                held = asyncio.create_task(c.post(f"{url}/v1/completions", json={**body, "n": 2}))
                for _ in range(1000):  # until the first request's two sequences are in flight
                    if state.in_flight == 2:
                        break
                    await asyncio.sleep(0.01)
                pair = await c.post(f"{url}/v1/completions", json={**body, "n": 2})  # 2 + 2 > 3
                single = asyncio.create_task(c.post(f"{url}/v1/completions", json={**body, "max_tokens": 4}))
                return pair, await single, await held

        pair, single, held = asyncio.run(main())
        assert pair.status_code == 429 and pair.json()["error"]["type"] == "rate_limit_error"
        assert single.status_code == 200 and held.status_code == 200
        assert held.json()["usage"]["completion_tokens"] == 800


@pytest.mark.slow
def test_soak_concurrent_streams_with_drops():
    """A few hundred concurrent streaming requests, some clients dropping mid-stream."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.serving_online import make_prompts, run_load, summarize

    with running_server(
        max_queue=1000, max_model_len=256, max_num_seqs=32, max_num_batched_tokens=128, num_gpu_blocks_override=160
    ) as (url, app):
        prompts = make_prompts(200, "random", 12, seed=1)
        results, seconds = asyncio.run(
            run_load(
                url,
                MODEL_NAME,
                prompts,
                rate=None,
                arrival="burst",
                concurrency=None,
                max_tokens=10,
                drop_fraction=0.15,
                api_key=None,
            )
        )
        s = summarize(results, seconds)
        assert s["server_errors"] == 0 and s["malformed"] == 0 and s["statuses"] == {"200": 200}
        assert s["completed"] + s["dropped"] == 200 and s["dropped"] > 10
        assert eventually(lambda: core_stats(app).num_free_blocks == core_stats(app).num_blocks)
        call(app, "check_invariants")
