"""HTTP middleware. Each entry of MIDDLEWARE takes the server state and returns a Starlette "http"
middleware function; app.py adds them in order (the last added runs first). API keys are checked
outside all of them, by serve.auth.AuthMiddleware (pure ASGI)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request, Response

from serve.http.errors import error_response
from serve.http.state import ServerState
from serve.openai_protocol import OpenAIError

CallNext = Callable[[Request], Awaitable[Response]]
Middleware = Callable[[Request, CallNext], Awaitable[Response]]


def refuse_while_draining(state: ServerState) -> Middleware:
    """After SIGTERM (serve.http.drain), every route but the read-only ones answers 503 with
    Connection: close, while the requests already admitted finish."""

    async def middleware(request: Request, call_next: CallNext) -> Response:
        if state.drain.draining and request.url.path not in state.drain.open_paths:
            response = error_response(
                OpenAIError(503, "The server is shutting down.", type_="service_unavailable", code="server_draining")
            )
            response.headers["Connection"] = "close"
            return response
        return await call_next(request)

    return middleware


MIDDLEWARE: tuple[Callable[[ServerState], Middleware], ...] = (refuse_while_draining,)
