"""Hypothesis over the request schemas of the three generating routes, with streams running beside it:
any field with any JSON value (structured-output constraints included) is answered below 500, the
engine core is the same process at the end, and the streams beside it finish whole."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve.http.openai_protocol import ChatCompletionRequest, CompletionRequest
from serve.http.serving_responses import ResponsesRequest
from serve.sampling_params import STRUCTURED_FIELD_TYPES
from tests.reliability.reliability_helpers import background_streams
from tests.server_helpers import MODEL_NAME, running_server

ARTIFACTS = Path(os.environ.get("JAXINFRA_TEST_ARTIFACTS", Path(__file__).parent.parent / "test-artifacts"))
ROUTES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "/v1/completions": ({"prompt": "In the beginning", "max_tokens": 3}, sorted(CompletionRequest.model_fields)),
    "/v1/chat/completions": (
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        sorted(ChatCompletionRequest.model_fields),
    ),
    "/v1/responses": ({"input": "Hi", "max_output_tokens": 3}, sorted(ResponsesRequest.model_fields)),
}
EXAMPLES = 150
REPRODUCIBLE: dict[str, Any] = {"derandomize": True, "database": None}  # the same examples every CI run

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, 2, -1, 3, 8, 128, 2**31, 2**63])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["", "auto", "required", "none", "json_object", "text", "\ud800", "a" * 3000])
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
structured = st.dictionaries(st.sampled_from(sorted(STRUCTURED_FIELD_TYPES)), values, min_size=1, max_size=2)


@st.composite
def calls(draw: st.DrawFn) -> tuple[str, bytes]:
    """A route and a body: the route's valid minimum with up to 4 of its fields set to anything."""
    path = draw(st.sampled_from(sorted(ROUTES)))
    base, fields = ROUTES[path]
    body = {"model": MODEL_NAME, "temperature": 0, **base}
    body.update(draw(st.dictionaries(st.sampled_from(fields), values, max_size=4)))
    if draw(st.booleans()):
        body["structured_outputs"] = draw(structured)
    return path, json.dumps(body).encode()  # ensure_ascii: a lone surrogate goes as its \\u escape


@pytest.fixture(scope="module")
def server():
    with running_server(max_model_len=1024, num_gpu_blocks_override=512, request_timeout=300) as (url, app):
        yield url, app


@pytest.mark.slow
def test_fuzzed_requests_never_5xx_and_streams_beside_them_finish(server):
    url, app = server
    pid = app.state.server.engine.core.proc.pid
    statuses: Counter[int] = Counter()
    with background_streams(url, count=2, max_tokens=400) as streams, httpx.Client(base_url=url, timeout=120) as client:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        @given(calls())
        def probe(call: tuple[str, bytes]) -> None:
            path, body = call
            r = client.post(path, content=body, headers={"Content-Type": "application/json"})
            statuses[r.status_code] += 1
            assert r.status_code < 500, (path, body[:500], r.text[:500])

        probe()
    assert all(s.unharmed and s.tokens == 400 for s in streams), streams
    assert app.state.server.engine.healthy and app.state.server.engine.core.proc.pid == pid
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "fuzz_statuses.json").write_text(json.dumps(dict(sorted(statuses.items()))))
    assert statuses.total() >= EXAMPLES and statuses[200] > 0 and statuses[400] > 0
