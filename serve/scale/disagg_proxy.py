"""`jaxinfra serve --role proxy --prefill URL --decode URL`: one OpenAI endpoint over disaggregated engines.

Each request goes to a prefill engine with max_tokens=1 and kv_transfer_params {"do_remote_decode":
true}; the kv_transfer_params it answers (where its KV blocks are offered) go with the original
request to a decode engine, whose answer (streamed or not) is the client's (vLLM's toy proxy
protocol). A client that goes away cancels the upstream call, which closes its connection, so the
engine aborts the request. An unreachable or stuck prefill engine is an OpenAI 503 within
`prefill_timeout`; nothing is remembered, so the next request finds it again once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from serve.http.errors import add_error_handlers
from serve.http.openai_protocol import OpenAIError
from serve.scale.balancer import LeastOutstanding

GENERATING = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("authorization", "x-api-key")
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the answer."""


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request a prefill engine gets: the prompt, one sequence of one token, not streamed, its KV kept
    for decode (the decode engine makes every sequence, n of them, from the one prompt's blocks)."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens", "best_of")}
    out["max_tokens"], out["n"] = 1, 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


async def _until_disconnect(request: Request, call: Awaitable[T]) -> T:
    """`call`'s result, or ClientGone (with `call` cancelled) if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(call), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task not in done:
        task.cancel()
        raise ClientGone
    return task.result()


def _unavailable(role: str, url: str, e: Exception) -> OpenAIError:
    what = "timed out" if isinstance(e, httpx.TimeoutException) else f"unreachable ({type(e).__name__})"
    return OpenAIError(503, f"The {role} engine {url} {what}", type_="service_unavailable", code=f"{role}_unavailable")


class Proxy:
    """The proxy's upstreams and its one HTTP client."""

    def __init__(
        self, prefill: list[str], decode: list[str], prefill_timeout: float = 30.0, connect_timeout: float = 2.0
    ) -> None:
        if prefill_timeout <= 0 or connect_timeout <= 0:
            raise ValueError(f"prefill_timeout ({prefill_timeout}) and connect_timeout ({connect_timeout}) must be > 0")
        self.prefill = LeastOutstanding(prefill, "prefill")
        self.decode = LeastOutstanding(decode, "decode")
        self.prefill_timeout = prefill_timeout
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=connect_timeout))

    async def _send(self, pool: LeastOutstanding, send: Callable[[str], Awaitable[T]]) -> tuple[str, T]:
        """`send` to the least loaded engine of `pool`, on to the next while they refuse connections; any
        other failure is a 503 (not a 500: an engine killed as we connect can make anyio's get_extra_info
        raise AttributeError). The engine answering stays counted as outstanding until the caller releases it."""
        error: Exception | None = None
        for url in pool.ranked():
            pool.acquire(url)
            try:
                return url, await send(url)
            except httpx.ConnectError as e:
                pool.release(url)
                error = e
            except Exception as e:  # it may have taken the request: do not run it twice
                pool.release(url)
                raise _unavailable(pool.role, url, e) from e
            except BaseException:
                pool.release(url)
                raise
        assert error is not None
        raise _unavailable(pool.role, url, error) from error

    async def _call(self, pool: LeastOutstanding, send: Callable[[str], Awaitable[httpx.Response]]) -> httpx.Response:
        """One whole answer from an engine of `pool`."""
        url, response = await self._send(pool, send)
        pool.release(url)
        return response

    async def generate(self, request: Request, path: str) -> Response:
        """Prefill, then decode with the prefill's kv_transfer_params; the decode engine's answer."""
        try:
            body = await request.json()
        except json.JSONDecodeError:
            raise OpenAIError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        prefill_body = prefill_request(body)
        try:
            prefilled = await _until_disconnect(
                request,
                self._call(
                    self.prefill,
                    lambda url: self.client.post(
                        url + path, json=prefill_body, headers=headers, timeout=self.prefill_timeout
                    ),
                ),
            )
            if prefilled.status_code != 200:
                return Response(prefilled.content, prefilled.status_code, media_type="application/json")
            decode_body = {**body, "kv_transfer_params": prefilled.json().get("kv_transfer_params")}
            if body.get("stream"):
                return await self._stream(request, path, decode_body, headers)
            decoded = await _until_disconnect(
                request,
                self._call(self.decode, lambda url: self.client.post(url + path, json=decode_body, headers=headers)),
            )
        except ClientGone:
            return Response(status_code=499)
        return Response(decoded.content, decoded.status_code, media_type="application/json")

    async def _stream(self, request: Request, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        """The decode engine's SSE stream, passed through; it closes its upstream when the client goes."""

        async def open_stream(url: str) -> httpx.Response:
            req = self.client.build_request("POST", url + path, json=body, headers=headers)
            return await self.client.send(req, stream=True)

        url, upstream = await _until_disconnect(request, self._send(self.decode, open_stream))
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            self.decode.release(url)
            return Response(content, upstream.status_code, media_type="application/json")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                self.decode.release(url)

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def models(self, request: Request) -> Response:
        """A decode engine's /v1/models (every engine serves the same model)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        r = await self._call(self.decode, lambda url: self.client.get(url + "/v1/models", headers=headers))
        return Response(r.content, r.status_code, media_type="application/json")

    def status(self) -> dict[str, Any]:
        """In-flight requests per upstream engine."""
        return {"prefill": dict(self.prefill.outstanding), "decode": dict(self.decode.outstanding)}


def build_proxy_app(proxy: Proxy) -> FastAPI:
    """The proxy's OpenAI endpoint: completions and chat (streaming or not), /v1/models, /health."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.client.aclose()

    app = FastAPI(title="jaxinfra disaggregation proxy", lifespan=lifespan)
    add_error_handlers(app)
    app.state.proxy = proxy
    for path in GENERATING:
        app.add_api_route(path, _generating_route(proxy, path), methods=["POST"])
    app.add_api_route("/v1/models", proxy.models, methods=["GET"])
    app.add_api_route("/health", proxy.status, methods=["GET"])
    return app


def _generating_route(proxy: Proxy, path: str) -> Callable[[Request], Awaitable[Response]]:
    async def generate(request: Request) -> Response:
        return await proxy.generate(request, path)

    return generate


def run_proxy(prefill: list[str], decode: list[str], host: str, port: int, prefill_timeout: float) -> int:
    """Serve the proxy until interrupted (`jaxinfra serve --role proxy`); a bad flag is a ValueError."""
    import uvicorn

    app = build_proxy_app(Proxy(prefill, decode, prefill_timeout=prefill_timeout))
    print(f"proxy on http://{host}:{port}: prefill {', '.join(prefill)}; decode {', '.join(decode)}", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return 0
