"""HTTP middleware. Each entry of MIDDLEWARE takes the server state and returns a Starlette "http"
middleware function; app.py adds them in order (the last added runs first)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request, Response

from serve.http.errors import error_response
from serve.http.state import ServerState
from serve.openai_protocol import OpenAIError

CallNext = Callable[[Request], Awaitable[Response]]
Middleware = Callable[[Request, CallNext], Awaitable[Response]]


def api_key_auth(state: ServerState) -> Middleware:
    """With --api-key, /v1 routes need 'Authorization: Bearer KEY' (a 401 otherwise)."""

    async def auth(request: Request, call_next: CallNext) -> Response:
        if (
            state.api_key
            and request.url.path.startswith("/v1")
            and request.headers.get("authorization", "") != f"Bearer {state.api_key}"
        ):
            return error_response(OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key"))
        return await call_next(request)

    return auth


MIDDLEWARE: tuple[Callable[[ServerState], Middleware], ...] = (api_key_auth,)
