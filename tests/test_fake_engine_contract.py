"""The fake core (tests/fake_engine.py) is held to the real one: it has CoreProcess's interface, and the
same requests through a real server and a fake-engine server get answers of the same shape (the same
keys at every level, the same finish reasons, counts and errors), streamed and not. Only the tokens differ."""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from serve.engine.core_client import CoreHandle, CoreProcess
from tests.fake_engine import ALPHABET, FakeCore, fake_server
from tests.server_helpers import MODEL_NAME, running_server

CHAT = [{"role": "user", "content": "hi"}]
LETTER = {str(ALPHABET[0]): 100}
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "And God said", "max_tokens": 5, "temperature": 0, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "n": 2, "logprobs": 2, "seed": 1, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "echo": True, "logprobs": 1, "ignore_eos": True}),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3, "prompt_logprobs": 1, "ignore_eos": True}),
    (
        "/v1/completions",
        {"prompt": "x", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True},
    ),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "stream": True, "logprobs": 1, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "ignore_eos": True}),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "ignore_eos": True},
    ),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "stream": True, "ignore_eos": True}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 3}),
    ("/v1/completions", {"prompt": "x" * 2000, "max_tokens": 3}),  # past max_model_len: refused
    ("/v1/completions", {"prompt": [600], "max_tokens": 3}),  # outside the vocabulary: refused
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "stop_token_ids": [9999]}),  # refused
    ("/tokenize", {"prompt": "hi"}),
]


def shape(value: Any, keyed_by_token: bool = False) -> Any:
    """The structure of a JSON value: dicts by their keys, lists by their first element, leaves by type
    (ids and texts differ, their kinds may not); completions' top_logprobs are keyed by token texts."""
    if isinstance(value, dict) and keyed_by_token and all(isinstance(v, float) for v in value.values()):
        return {"<token>": sorted({shape(v) for v in value.values()})}
    if isinstance(value, dict):
        ignored = ("id", "created", "created_at")
        return {k: shape(v, k == "top_logprobs") for k, v in sorted(value.items()) if k not in ignored}
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return "list[int]"  # token ids, a token's bytes (none for a special token)
    if isinstance(value, list):
        return [shape(value[0], keyed_by_token)] if value else []
    return type(value).__name__ if value is not None else None


def answer(client: httpx.Client, path: str, body: dict[str, Any]) -> Any:
    if path in ("/v1/completions", "/v1/chat/completions"):
        body = {"logit_bias": LETTER, **body}  # the real model writes letters too (the fake ignores the bias)
    r = client.post(path, json={"model": MODEL_NAME, **body})
    if body.get("stream"):
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
        # how many chunks is the detokenizer's business (a real model's bytes may need two tokens)
        return r.status_code, sorted({json.dumps(shape(c), sort_keys=True) for c in chunks})
    data = r.json()
    if isinstance(data.get("error"), dict):
        return r.status_code, shape(data), data["error"]["param"]
    finish = [c.get("finish_reason") for c in data.get("choices", [])]
    return r.status_code, shape(data), finish, data.get("usage", {}).get("completion_tokens")


@pytest.fixture(scope="module")
def both() -> Iterator[tuple[httpx.Client, httpx.Client]]:
    with (
        running_server() as (real_url, _),
        fake_server() as (fake_url, _),
        httpx.Client(base_url=real_url, timeout=120) as real,
        httpx.Client(base_url=fake_url, timeout=120) as fake,
    ):
        yield real, fake


def test_the_fake_core_has_the_interface_of_core_process() -> None:
    members = [m for m in dir(CoreHandle) if not m.startswith("_")] + list(CoreHandle.__annotations__)
    assert {"send", "recv", "watch", "close", "kill", "info", "alive"} <= set(members)
    for name in members:
        if name in CoreHandle.__annotations__:
            continue  # attributes: set in both constructors (checked by the answers below)
        real, fake = getattr(CoreProcess, name), getattr(FakeCore, name)
        assert isinstance(real, property) == isinstance(fake, property), name
        if not isinstance(real, property):
            assert inspect.signature(real) == inspect.signature(fake), name
            assert inspect.iscoroutinefunction(real) == inspect.iscoroutinefunction(fake), name
    assert inspect.signature(CoreProcess.__init__) == inspect.signature(FakeCore.__init__)


@pytest.mark.parametrize("path, body", REQUESTS, ids=[f"{p} {sorted(b)}" for p, b in REQUESTS])
def test_real_and_fake_answers_have_the_same_shape(
    both: tuple[httpx.Client, httpx.Client], path: str, body: dict[str, Any]
) -> None:
    real, fake = both
    assert answer(fake, path, body) == answer(real, path, body)


def test_metrics_and_health_read_the_same(both: tuple[httpx.Client, httpx.Client]) -> None:
    real, fake = both
    assert real.get("/health").status_code == fake.get("/health").status_code == 200

    def names(client: httpx.Client) -> set[str]:
        lines = client.get("/metrics").text.splitlines()
        return {line.split("{")[0].split(" ")[0] for line in lines if not line.startswith("#")}

    assert names(real) == names(fake)
