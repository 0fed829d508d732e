"""API-key authentication as current vLLM does it, with tenants: an ASGI middleware that finds the
request's key (`Authorization: Bearer KEY`, the scheme in any case, or `x-api-key: KEY`), matches it
in constant time against the keys' SHA-256 digests and puts the key's Tenant in the request's state.

Every route needs a key except the open ones (`/health`, `/version`, `/ping`, and `/metrics` unless
the server protects it). Keys are never logged: only their digests are kept.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Mapping

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from serve.http.openai_protocol import OpenAIError
from serve.http.tenants import Tenant

OPEN_PATHS = frozenset({"/health", "/version", "/ping"})


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class KeyRing:
    """Digests of the accepted keys, each with its tenant. `lookup` compares the presented key's
    digest with every stored digest (no early exit), so its time does not depend on which key
    matched or how much of one did."""

    def __init__(self, tenants_by_digest: Mapping[bytes, Tenant]) -> None:
        self._entries = list(tenants_by_digest.items())

    @staticmethod
    def single(api_key: str) -> dict[bytes, Tenant]:
        """The one `--api-key`: an operator tenant with no limits that shares the default prefix cache."""
        return {key_digest(api_key): Tenant(name="default", prefix_cache_group="", operator=True)}

    def __len__(self) -> int:
        return len(self._entries)

    def tenants(self) -> list[Tenant]:
        """Each tenant once, in the file's order."""
        return list(dict.fromkeys(tenant for _, tenant in self._entries))

    def lookup(self, key: str) -> Tenant | None:
        digest = key_digest(key)
        found: Tenant | None = None
        for stored, tenant in self._entries:
            if secrets.compare_digest(digest, stored):
                found = tenant
        return found


def presented_key(headers: Headers) -> str | None:
    """The key a request carries: `Authorization: Bearer KEY` (scheme case-insensitive) or `x-api-key`."""
    scheme, _, param = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and param.strip():
        return param.strip()
    return headers.get("x-api-key") or None


class AuthMiddleware:
    """Refuses requests without a known key with OpenAI's 401 error; passes the tenant on as
    `request.state.tenant` (None on open routes, or when the server has no keys)."""

    def __init__(self, app: ASGIApp, keys: KeyRing | None, open_paths: Iterable[str] = OPEN_PATHS) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not self.keys:
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        key = presented_key(Headers(scope=scope))
        tenant = self.keys.lookup(key) if key is not None else None
        if tenant is None and path not in self.open_paths:
            error = OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key")
            await JSONResponse(error.body(), status_code=401)(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
