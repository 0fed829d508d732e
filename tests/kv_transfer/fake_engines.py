"""Stand-in prefill and decode engines for the proxy tests: they speak the OpenAI wire format, record
what they were sent and whether the proxy went away mid-request."""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


class FakeEngine:
    """One engine: `bodies` holds every request it got, `aborted` the ones whose client left first."""

    def __init__(self, name: str, delay: float = 0.0, chunks: int = 3, chunk_delay: float = 0.0) -> None:
        self.name, self.delay, self.chunks, self.chunk_delay = name, delay, chunks, chunk_delay
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.aborted: list[int] = []

    def text(self, body: dict[str, Any]) -> str:
        kv = body.get("kv_transfer_params") or {}
        return f"{self.name}<-{kv.get('remote_engine', 'none')}"

    def app(self) -> FastAPI:
        app = FastAPI()
        app.state.server = types.SimpleNamespace(engine=types.SimpleNamespace(shutdown=lambda: None))
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.add_api_route(path, self._route(path == "/v1/chat/completions"), methods=["POST"])
        app.add_api_route("/v1/models", lambda: {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        return app

    def _route(self, chat: bool):
        async def generate(request: Request) -> Any:
            body = await request.json()
            n = len(self.bodies)
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            waited = 0.0
            while waited < self.delay:  # as the engine server does: a client that leaves aborts
                if await request.is_disconnected():
                    self.aborted.append(n)
                    return {}
                await asyncio.sleep(0.05)
                waited += 0.05
            if body.get("stream"):
                return StreamingResponse(self._stream(n, body, chat), media_type="text/event-stream")
            return self._answer(body, chat)

        return generate

    def _answer(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        text = self.text(body)
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        base = {"id": "cmpl-1", "created": 0, "model": "tiny", "usage": usage}
        if self.name.startswith("prefill"):
            base["kv_transfer_params"] = {"remote_engine": self.name, "remote_block_ids": [1, 2]}
        if chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": "length"}
            return {**base, "object": "chat.completion", "choices": [choice]}
        choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
        return {**base, "object": "text_completion", "choices": [choice]}

    async def _stream(self, n: int, body: dict[str, Any], chat: bool) -> AsyncIterator[str]:
        done = False
        try:
            for i in range(self.chunks):
                piece = self.text(body) if i == 0 else f" {i}"
                if chat:
                    choice = {"index": 0, "delta": {"content": piece}, "finish_reason": None}
                    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "tiny"}
                else:
                    choice = {"index": 0, "text": piece, "finish_reason": None, "logprobs": None}
                    chunk = {"id": "c", "object": "text_completion", "created": 0, "model": "tiny"}
                yield f"data: {json.dumps({**chunk, 'choices': [choice]})}\n\n"
                await asyncio.sleep(self.chunk_delay)
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if not done:
                self.aborted.append(n)
