"""Nothing that grows with a request's size runs on the server's event loop: every route's chat template
and tokenizing run on worker threads (the loop serves every stream; a long prompt tokenized on it would
stall them all). Checked by the thread each call ran on, with prompts under every limit so that they are
really templated and tokenized: a structure load cannot blur, unlike a stream's gaps."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fake_engine import fake_server
from tests.server_helpers import MODEL_NAME

LONG = "In the beginning God created the heaven and the earth. " * 32  # 1,792 tokens: under every bound
ROUTES = [
    ("/v1/completions", {"prompt": LONG, "max_tokens": 2}),
    ("/v1/completions", {"prompt": [LONG[:500], LONG[500:1000]], "max_tokens": 2}),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 2, "stream": True}),
    ("/v1/responses", {"input": LONG, "max_output_tokens": 2}),
    ("/v1/responses", {"input": LONG, "max_output_tokens": 2, "stream": True}),
    ("/tokenize", {"prompt": LONG}),
    ("/tokenize", {"messages": [{"role": "user", "content": LONG}]}),
]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Any]]:
    with fake_server(max_model_len=2048) as served:
        yield served


def loop_thread(app: Any) -> int:
    async def ident() -> int:
        return threading.get_ident()

    return asyncio.run_coroutine_threadsafe(ident(), app.state.loop).result(timeout=10)


@pytest.mark.parametrize("path, body", ROUTES, ids=[f"{p} {sorted(b)}" for p, b in ROUTES])
def test_templates_and_tokenizing_run_off_the_event_loop(
    server: tuple[str, Any], monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any]
) -> None:
    url, app = server
    tokenizer = app.state.server.engine.tokenizer
    ran: list[tuple[str, int]] = []
    for name in ("encode", "apply_chat_template"):
        original = getattr(tokenizer, name)

        def recorded(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            ran.append((_name, threading.get_ident()))
            return _original(*args, **kwargs)

        monkeypatch.setattr(tokenizer, name, recorded)
    r = httpx.post(f"{url}{path}", json={"model": MODEL_NAME, **body}, timeout=60)
    assert r.status_code == 200, r.text
    wanted = {"encode"} | ({"apply_chat_template"} if "messages" in body or path == "/v1/responses" else set())
    assert {name for name, _ in ran} >= wanted, ran
    loop = loop_thread(app)
    assert [name for name, thread in ran if thread == loop] == [], "ran on the event loop"
