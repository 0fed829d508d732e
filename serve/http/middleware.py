"""HTTP middleware, pure ASGI: a streamed response's chunks pass straight through (Starlette's
function middleware relays every chunk through a task and a memory stream: per-token streams paid
that on every chunk). Each entry of MIDDLEWARE is a class taking the app and the server state; app.py
adds them in order (the last added runs first). API keys are checked outside all of them, by
serve.auth.AuthMiddleware."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from serve.http.errors import error_response
from serve.http.state import ServerState
from serve.openai_protocol import OpenAIError


class RefuseWhileDraining:
    """After SIGTERM (serve.http.drain), every route but the read-only ones answers 503 with
    Connection: close, while the requests already admitted finish."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        drain = self.state.drain
        if scope["type"] == "http" and drain.draining and _path(scope) not in drain.open_paths:
            response = error_response(
                OpenAIError(503, "The server is shutting down.", type_="service_unavailable", code="server_draining")
            )
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _path(scope: Scope) -> str:
    return scope["path"].removeprefix(scope.get("root_path", "")) or "/"


MIDDLEWARE: tuple[type[RefuseWhileDraining], ...] = (RefuseWhileDraining,)
