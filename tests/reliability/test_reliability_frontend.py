"""Hostile input against one server while 3 streams run: huge bodies are 413s before anything reads or
tokenizes them, abandoned calls are aborted, a pathological grammar is a 400 checked outside the server's
process, impossible requests are 400s, and a fuzzer over the OpenAI request shapes finds no 5xx. The
streams' gaps are reported, not asserted: that nothing blocks the event loop is checked by what ran where
(here and in tests/test_frontend_event_loop.py), which load cannot blur."""

import asyncio
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import serve.core.structured_output
from serve.http.openai_protocol import ChatCompletionRequest, CompletionRequest
from tests.reliability.reliability_helpers import Tally, background_streams, normal_worst_gap, reliability_server
from tests.server_helpers import MODEL_NAME, call, eventually, metric

pytestmark = pytest.mark.slow
TALLY = Tally("frontend")


@pytest.fixture(scope="module")
def server():
    with reliability_server() as (url, app, engine):
        normal_worst_gap(url, max_tokens=40)  # compiles the shapes the probes' streams use
        yield url, app, engine
    print("\n" + TALLY.report())


def test_huge_bodies_are_refused_unread_while_streams_and_health_stay_live(server, monkeypatch):
    url, _, engine = server
    health = []
    tokenized: list[str] = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(
        engine.tokenizer, "encode", lambda text, *a, **k: tokenized.append(text) or encode(text, *a, **k)
    )
    with background_streams(url) as streams, httpx.Client(timeout=60) as c:
        big = {"model": MODEL_NAME, "prompt": "x" * 5_000_000, "max_tokens": 1}
        r = c.post(f"{url}/v1/completions", json=big)
        assert TALLY.answer(r.status_code) == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit counts the bytes as they arrive
            for _ in range(100):
                yield b'{"prompt": "' + b"y" * 10_000
            yield b'"}'

        r = c.post(f"{url}/tokenize", content=chunks(), headers={"content-type": "application/json"})
        assert TALLY.answer(r.status_code) == 413
        for _ in range(5):
            t0 = time.monotonic()
            assert c.get(f"{url}/health").status_code == 200
            health.append(time.monotonic() - t0)
    TALLY.watch(streams, "5 MB and 1 MB bodies")
    TALLY.notes.append(f"/health worst {max(health):.3f} s beside 5 MB and 1 MB bodies")
    assert all(s.unharmed for s in streams)
    assert not [t for t in tokenized if len(t) > 1000]  # the refused bodies were never tokenized
    assert max(health) < 1.0


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(server):
    url, _, engine = server
    prompt = "z" * (engine.max_model_len * 17 + 1)  # 17: the most characters one tiny-qwen3 token covers
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}, timeout=60)
    assert TALLY.answer(r.status_code) == 400
    assert "characters" in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"


def test_impossible_requests_are_400s_not_429s(server):
    url, _, engine = server
    n = engine.args.max_num_seqs + 1
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "n": n})
    assert TALLY.answer(r.status_code) == 400 and "can never run" in r.json()["error"]["message"]
    many = {"model": MODEL_NAME, "prompt": ["x"] * 10, "max_tokens": 2, "n": 8}  # 80 > 8 running + 64 queued
    r = httpx.post(f"{url}/v1/completions", json=many)
    assert TALLY.answer(r.status_code) == 400


def test_abandoned_non_streaming_calls_are_aborted(server):
    url, app, _ = server
    before = metric(url, "jaxinfra:request_success_total", finished_reason="abort")
    body = {"model": MODEL_NAME, "prompt": "keep going", "max_tokens": 900, "temperature": 0, "ignore_eos": True}

    async def abandon() -> None:
        async with httpx.AsyncClient(timeout=1.0) as c:
            with pytest.raises(httpx.TimeoutException):
                await c.post(f"{url}/v1/completions", json=body)

    async def main() -> None:
        await asyncio.gather(*(abandon() for _ in range(20)))

    asyncio.run(main())
    TALLY.probes += 20
    gone = time.monotonic()
    aborted = lambda: metric(url, "jaxinfra:request_success_total", finished_reason="abort") - before
    assert eventually(lambda: aborted() >= 20, timeout=1.0), aborted()
    TALLY.notes.append(f"20 abandoned calls aborted in /metrics after {time.monotonic() - gone:.3f} s")
    stats = lambda: call(app, "stats")
    assert eventually(lambda: stats().num_free_blocks == stats().num_blocks, timeout=30)


def test_a_pathological_regex_is_a_400_checked_outside_the_server(server, monkeypatch):
    """The frontend never builds a grammar itself (its checker child does, under a budget): work that would
    hold its event loop for as long as the grammar takes."""
    url, _, engine = server
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 5, "guided_regex": "(a{1000}){1000}"}
    warm = httpx.post(f"{url}/v1/completions", json={**body, "guided_regex": "a+"}, timeout=180)  # starts the checker
    assert warm.status_code == 200, warm.text
    checked_here: list[object] = []
    validate = serve.core.structured_output.validate
    monkeypatch.setattr(serve.core.structured_output, "validate", lambda *a: checked_here.append(a) or validate(*a))
    with background_streams(url) as streams:
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        took = time.monotonic() - t0
    TALLY.watch(streams, "the regex")
    TALLY.notes.append(f"(a{{1000}}){{1000}} answered {r.status_code} in {took:.2f} s")
    assert TALLY.answer(r.status_code) == 400 and "grammar" in r.json()["error"]["message"]
    assert all(s.unharmed for s in streams)
    assert not checked_here  # neither the event loop nor any thread of the server's process compiled it
    child = engine.grammar_checker._proc
    assert child is not None and child.returncode is None  # the checker child did, and still serves


FIELDS = sorted(set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields))
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
ROUTES = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
BASES = {
    "/v1/completions": {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3},
    "/v1/chat/completions": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/tokenize": {"model": MODEL_NAME, "prompt": "hi"},
    "/detokenize": {"model": MODEL_NAME, "tokens": [1, 2]},
}


def _cheap(body: object) -> object:
    """Valid-looking token budgets stay tiny, so a fuzzed call that runs is over in a few steps."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "n", "best_of"):
            if isinstance(body.get(key), int) and 0 < body[key] < 2**31:
                body[key] = min(body[key], 3)
    return body


def test_fuzzed_requests_get_no_5xx_and_harm_no_stream(server):
    url, _, _ = server
    statuses: list[int] = []

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(
        route=ROUTES,
        fields=st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=5),
        raw=st.none() | VALUES,
    )
    def fuzz(route: str, fields: dict, raw: object) -> None:
        body = _cheap(raw if raw is not None and not fields else {**BASES[route], **fields})
        r = client.post(f"{url}{route}", content=json.dumps(body), headers={"content-type": "application/json"})
        statuses.append(TALLY.answer(r.status_code))
        assert r.status_code < 500, (route, body, r.text)
        if r.status_code >= 400:
            assert r.json()["error"]["message"], r.text

    with background_streams(url) as streams, httpx.Client(timeout=120) as client:
        fuzz()
    TALLY.watch(streams, "the fuzzer")
    TALLY.notes.append(f"fuzzer: {len(statuses)} calls, {sum(s < 300 for s in statuses)} answered 2xx")
    assert all(s.unharmed for s in streams)
