"""A hostile client's malformed requests: each is a 4xx with OpenAI's error JSON naming the field (never
a 500), and the keep-alive connection it came on serves the next request. One server for the module, a
real uvicorn and frontend over the fake core (the requests that pass validation need no real tokens)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.responses import JSONResponse

from serve.http.openai_protocol import OpenAIError
from serve.sampling_params import SamplingParams
from tests.fake_engine import fake_server
from tests.server_helpers import MODEL_NAME

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
RESPONSE = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Any]]:
    with fake_server() as served:
        yield served


@pytest.fixture(scope="module")
def client(server: tuple[str, Any]) -> Iterator[httpx.Client]:
    """One client, so each bad request's keep-alive connection carries the next request."""
    with httpx.Client(base_url=server[0], timeout=120) as c:
        yield c


def refused(client: httpx.Client, path: str, raw: str, param: str | None, status: int = 400) -> dict[str, Any]:
    """POST a raw JSON body: a `status` error naming `param`; the next request on the connection works."""
    r = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == status, (raw[:200], r.status_code, r.text[:500])
    assert r.headers.get("connection") != "close", raw[:200]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["param"] == param, (raw[:200], error)
    ok = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    return error


def test_lone_surrogates_get_encodable_errors(client: httpx.Client) -> None:
    """A lone surrogate (a JSON \\ud800 escape) in any field is a 400 naming it; the error JSON, which
    once quoted it and could not be encoded (a 500), is always valid UTF-8."""
    bad = "\ud800"
    cases = [
        ("/v1/completions", {**COMPLETION, "model": bad}, "model"),
        ("/v1/chat/completions", {**CHAT, "model": bad}, "model"),
        ("/v1/responses", {**RESPONSE, "model": bad}, "model"),
        ("/v1/responses", {**RESPONSE, "previous_response_id": bad}, "previous_response_id"),
        ("/v1/responses", {**RESPONSE, "metadata": {"x": bad}}, "metadata"),
        ("/v1/responses", {**RESPONSE, "metadata": {bad: "x"}}, "metadata"),
    ]
    for path, body, param in cases:
        error = refused(client, path, json.dumps(body), param)  # json.dumps writes the surrogate as \\ud800
        assert "\\ud800" in error["message"], error


def test_error_bodies_are_always_encodable() -> None:
    body = JSONResponse(OpenAIError(404, "The model '\ud800' does not exist.", param="\udfff").body()).body
    assert json.loads(bytes(body))["error"] == {
        "message": "The model '\\ud800' does not exist.",
        "type": "invalid_request_error",
        "param": "\\udfff",
        "code": None,
    }


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"input": [{"role": "user", "content": 5}]}, "input"),
        ({"input": [{"role": "nobody", "content": "hi"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input"),
        ({"input": [{"role": "user", "content": ["hi"]}]}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input"),
        ({"text": {"format": "json"}}, "text"),
        ({"text": {"format": {"type": "yaml"}}}, "text"),
        ({"text": "json"}, "text"),
    ],
)
def test_responses_input_and_text_of_the_wrong_shape(client: httpx.Client, fields: dict, param: str) -> None:
    refused(client, "/v1/responses", json.dumps({**RESPONSE, **fields}), param)


def test_a_named_tool_choice_whose_function_is_not_an_object(client: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {**CHAT, "tools": tools, "tool_choice": {"type": "function", "function": "f"}}
    refused(client, "/v1/chat/completions", json.dumps(body), "tool_choice")


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/responses", RESPONSE, "metadata"),
        ("/v1/chat/completions", CHAT, "metadata"),
        ("/v1/completions", COMPLETION, "logit_bias"),
        ("/v1/chat/completions", CHAT, "temperature"),
    ],
)
@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused(client: httpx.Client, path: str, body: dict, field: str, constant: str) -> None:
    """Python's json reads NaN and Infinity (JSON has neither): refused up front, not after generating
    (an echoed `metadata: {"x": NaN}` once failed to encode once the answer was ready)."""
    value = f'{{"5": {constant}}}' if field in ("metadata", "logit_bias") else constant
    refused(client, path, json.dumps(body)[:-1] + f', "{field}": {value}}}', field)


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_nested_300_deep_is_a_400_naming_its_field(client: httpx.Client) -> None:
    deep = nested_schema(300)
    refused(client, "/v1/completions", json.dumps({**COMPLETION, "guided_json": deep}), "guided_json")
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}
    refused(client, "/v1/chat/completions", json.dumps({**CHAT, "response_format": fmt}), "response_format")
    text = {"format": {"type": "json_schema", "name": "x", "schema": deep}}
    refused(client, "/v1/responses", json.dumps({**RESPONSE, "text": text}), "text")
    refused(client, "/v1/completions", json.dumps({**COMPLETION, "guided_json": json.dumps(deep)}), "guided_json")
    brackets = "[" * 60_000 + "]" * 60_000  # past the JSON parser's recursion: once a 500
    refused(client, "/v1/completions", json.dumps({**COMPLETION, "guided_json": brackets}), "guided_json")
    refused(client, "/v1/completions", json.dumps(COMPLETION)[:-1] + f', "stop": {brackets}}}', None)
    shallow = {**COMPLETION, "guided_json": nested_schema(5), "max_tokens": 8}
    assert client.post("/v1/completions", json=shallow).status_code == 200


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": 1e308}, "temperature"),
        ({"temperature": 1e-300}, "temperature"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"top_p": 1e-300}, "top_p"),
        ({"length_penalty": 1e300, "use_beam_search": True, "best_of": 2}, "length_penalty"),
    ],
)
def test_sampling_values_float32_cannot_hold_are_400s(client: httpx.Client, fields: dict, param: str) -> None:
    """1e308 was inf on device (random text) and 1e-300 was 0 (a division by zero)."""
    refused(client, "/v1/completions", json.dumps({**COMPLETION, **fields}), param)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 1e39),
        ("temperature", 1e-300),
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 1e39),
        ("top_p", 1e-40),
        ("min_p", 1e-40),
        ("presence_penalty", 1e-40),
        ("length_penalty", 1e300),
    ],
)
def test_sampling_params_refuse_what_float32_cannot_hold(field: str, value: float) -> None:
    kwargs: dict[str, Any] = {field: value}
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**kwargs)


def test_sampling_params_keep_ordinary_values() -> None:
    p = SamplingParams(temperature=1e-5, repetition_penalty=1.3, top_p=1e-3, min_p=0.0, length_penalty=-2.0)
    assert (p.temperature, p.repetition_penalty, p.top_p) == (1e-5, 1.3, 1e-3)


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_like_health(client: httpx.Client, method: str) -> None:
    assert client.request(method, "/ping").status_code == client.get("/health").status_code == 200


def test_too_many_prompts_are_refused_before_tokenizing(
    server: tuple[str, Any], client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """60,000 one-character prompts (240 KB) once took seconds of tokenizing before their 400."""
    processor = server[1].state.server.engine.input_processor
    tokenized: list[object] = []  # the prompts tokenized (refused()'s next request tokenizes "x")
    tokenize = processor.tokenize

    def counted(prompt: object, *args: Any) -> list[int]:
        tokenized.append(prompt)
        return tokenize(prompt, *args)

    monkeypatch.setattr(processor, "tokenize", counted)
    raw = json.dumps({**COMPLETION, "prompt": ["a"] * 60_000}, separators=(",", ":"))  # 240 KB: under the body limit
    error = refused(client, "/v1/completions", raw, "prompt")
    assert "60000 prompts" in error["message"], error
    capacity = server[1].state.server.capacity
    refused(client, "/v1/completions", json.dumps({**COMPLETION, "prompt": ["a"] * capacity, "n": 2}), "prompt")
    assert tokenized and "a" not in tokenized
