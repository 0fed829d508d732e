"""HTTP middleware, pure ASGI: a streamed response's chunks pass straight through (Starlette's
function middleware relays every chunk through a task and a memory stream: per-token streams paid
that on every chunk). Each entry of MIDDLEWARE is a class taking the app and the server state; app.py
adds them in order (the last added runs first). API keys are checked outside all of them, by
serve.http.auth.AuthMiddleware."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from serve.http.errors import error_response, quota_response
from serve.http.openai_protocol import OpenAIError
from serve.http.state import ServerState


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


class RefuseOverQuota:
    """A generating call of a tenant that is over a quota any call would need (requests or tokens a
    minute, sequences in flight) gets its 429 before its body is read or parsed, and a repeated one
    only after a hold (TenantQuotas.hold_refusal): a flood of refused calls costs the server little of
    the CPU the other tenants' streams need."""

    paths = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenant = scope.get("state", {}).get("tenant") if scope["type"] == "http" else None
        if tenant is not None and scope["method"] == "POST" and _path(scope) in self.paths:
            refused = self.state.quotas.refusal(tenant)
            if refused is not None:
                await self.state.quotas.hold_refusal(tenant)
                await quota_response(refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _path(scope: Scope) -> str:
    return scope["path"].removeprefix(scope.get("root_path", "")) or "/"


MIDDLEWARE: tuple[type[RefuseWhileDraining | RefuseOverQuota], ...] = (RefuseOverQuota, RefuseWhileDraining)
