"""Keys, tenants and quotas without a server: the keys file's errors, constant-time lookup, the
middleware's open routes and header forms, and the quota windows on a fake clock."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from serve.http import tenants
from serve.http.auth import AuthMiddleware, KeyRing, key_digest
from serve.http.tenants import QuotaExceeded, Tenant, TenantQuotas, load_keys_file

KEYS_YAML = """
tenants:
  search: {requests_per_minute: 2, max_concurrent: 5}
  docs: {tokens_per_minute: 100, prefix_cache_group: shared}
  wiki: {prefix_cache_group: shared}
keys:
  sk-search-0001: search
  sha256:DIGEST: docs
  sk-wiki-000001: wiki
""".replace("DIGEST", hashlib.sha256(b"sk-docs-00001").hexdigest())


def test_keys_file_maps_keys_and_digests_to_tenants(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS_YAML)
    ring = KeyRing(load_keys_file(path))
    assert len(ring) == 3
    assert ring.lookup("sk-search-0001").name == "search"
    assert ring.lookup("sk-docs-00001").tokens_per_minute == 100
    assert ring.lookup("sk-search-0002") is None
    docs, wiki, search = ring.lookup("sk-docs-00001"), ring.lookup("sk-wiki-000001"), ring.lookup("sk-search-0001")
    assert docs.cache_salt(None) == wiki.cache_salt(None) != search.cache_salt(None)
    assert search.cache_salt("x") != search.cache_salt(None)  # the client's own salt still splits


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keys: {sk-aaaaaaaa: a}", "exactly 'tenants' and 'keys'"),
        ("tenants: {a: {}}\nkeys: {sk-aaaaaaaa: b}", "names unknown tenant 'b'"),
        ("tenants: {a: {tokens_per_minute: -1}}\nkeys: {sk-aaaaaaaa: a}", "tokens_per_minute must be a positive int"),
        ("tenants: {a: {tokens_per_min: 5}}\nkeys: {sk-aaaaaaaa: a}", "unknown field(s) ['tokens_per_min']"),
        ("tenants: {a: {}}\nkeys: {short: a}", "shorter than 8"),
        ("tenants: {a: {}}\nkeys: {'sha256:abc': a}", "not a valid sha256"),
        ("tenants: [a\n", "cannot read it"),
    ],
)
def test_bad_keys_file_is_a_clear_error_without_the_key(tmp_path, text, message):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="--api-keys-file") as e:
        load_keys_file(path)
    assert message in str(e.value)
    assert "sk-aaaaaaaa" not in str(e.value)


def _app(ring: KeyRing, open_paths=("/health",)) -> TestClient:
    async def who(request: Request) -> JSONResponse:
        tenant = request.state.tenant
        return JSONResponse({"tenant": tenant.name if tenant else None})

    app = Starlette(routes=[Route("/tokenize", who, methods=["POST"]), Route("/health", who)])
    app.add_middleware(AuthMiddleware, keys=ring, open_paths=open_paths)
    return TestClient(app)


def test_middleware_header_forms_and_open_routes():
    client = _app(KeyRing({key_digest("sk-search-0001"): Tenant("search")}))
    refused = client.post("/tokenize")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert client.post("/tokenize", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
    for headers in (
        {"Authorization": "Bearer sk-search-0001"},
        {"Authorization": "bearer sk-search-0001"},
        {"Authorization": "BEARER  sk-search-0001 "},
        {"x-api-key": "sk-search-0001"},
    ):
        ok = client.post("/tokenize", headers=headers)
        assert ok.status_code == 200 and ok.json() == {"tenant": "search"}, headers
    assert client.post("/tokenize", headers={"Authorization": "Basic sk-search-0001"}).status_code == 401
    assert client.get("/health").json() == {"tenant": None}


def test_quota_windows_and_retry_after():
    now = [1000.0]
    quotas = TenantQuotas(clock=lambda: now[0])
    rpm = Tenant("a", requests_per_minute=2, max_concurrent=5)
    tpm = Tenant("b", tokens_per_minute=100, max_concurrent=1)
    quotas.admit(rpm, 1)
    now[0] += 10
    quotas.admit(rpm, 1)
    with pytest.raises(QuotaExceeded) as e:
        quotas.admit(rpm, 1)
    assert e.value.retry_after == 50  # the first request leaves the window at 1060
    admitted = quotas.admit(tpm, 30)
    with pytest.raises(QuotaExceeded, match="in flight"):
        quotas.admit(tpm, 1)
    quotas.release(tpm, admitted, 60)  # 90 tokens in the window now
    now[0] += 5
    with pytest.raises(QuotaExceeded, match="100 tokens per minute") as e:
        quotas.admit(tpm, 20)
    assert e.value.retry_after == 55  # the call's 90 tokens leave the window a minute after its admission
    now[0] += 56
    quotas.admit(tpm, 20)
    snap = quotas.snapshot()
    assert snap["b"]["refused"] == 2 and snap["b"]["admitted"] == 2 and snap["b"]["tokens_last_minute"] == 20


def test_a_refusal_soon_after_another_is_held():
    """The first refusal is answered at once; one within HOLD_S of the previous waits HOLD_S, up to
    MAX_HELD at once (past it, at once again); a refusal after a quiet spell is answered at once."""
    now = [0.0]
    slept: list[float] = []
    release = asyncio.Event()

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        await release.wait()

    quotas = TenantQuotas(clock=lambda: now[0], sleep=sleep)
    flood = Tenant("flood", requests_per_minute=1)
    quotas.admit(flood, 1)

    async def refuse() -> None:
        assert quotas.refusal(flood) is not None
        await quotas.hold_refusal(flood)

    async def scenario() -> None:
        await refuse()
        assert slept == []
        now[0] += tenants.HOLD_S / 2
        held = [asyncio.create_task(refuse()) for _ in range(tenants.MAX_HELD)]
        await asyncio.sleep(0)
        assert slept == [tenants.HOLD_S] * tenants.MAX_HELD and quotas.usage["flood"].held == tenants.MAX_HELD
        await refuse()  # past MAX_HELD: answered at once
        release.set()
        await asyncio.gather(*held)
        assert quotas.usage["flood"].held == 0
        now[0] += tenants.HOLD_S * 2
        await refuse()
        assert len(slept) == tenants.MAX_HELD

    asyncio.run(scenario())


def test_quotas_count_sequences_and_reserve_max_tokens():
    """max_concurrent counts sequences (one call of n=3 holds 3); tokens_per_minute reserves the prompt
    and max_tokens for each sequence at admission and hands back what was not generated; a call that
    could never fit is a ValueError (a 400), not a 429 to retry forever."""
    now = [0.0]
    quotas = TenantQuotas(clock=lambda: now[0])
    seqs = Tenant("s", max_concurrent=4)
    first = quotas.admit(seqs, 5, sequences=3)
    with pytest.raises(QuotaExceeded, match="3 sequences in flight and this request needs 2 more"):
        quotas.admit(seqs, 5, sequences=2)
    with pytest.raises(ValueError, match="needs 5 sequences"):
        quotas.admit(seqs, 5, sequences=5)
    quotas.release(seqs, first, 0)
    quotas.admit(seqs, 5, sequences=4)
    toks = Tenant("t", tokens_per_minute=100)
    a = quotas.admit(toks, 10, sequences=2, max_new_tokens=20)  # reserves 50
    quotas.admit(toks, 10, sequences=2, max_new_tokens=20)  # 100: the limit
    with pytest.raises(QuotaExceeded, match="reserves 30"):
        quotas.admit(toks, 10, sequences=1, max_new_tokens=20)
    quotas.release(toks, a, 5)  # it generated 5 of its 40: 15 + 50 in the window
    quotas.admit(toks, 10, sequences=1, max_new_tokens=20)
    assert quotas.snapshot()["t"]["tokens_last_minute"] == 95
    with pytest.raises(ValueError, match="reserves 210 tokens"):
        quotas.admit(toks, 10, sequences=2, max_new_tokens=100)


@pytest.mark.parametrize("salt", ["tenant:beta\x00", '"beta", null', 'beta", null]', '["beta", null]', "beta", ""])
def test_no_request_salt_spells_another_tenants_cache_salt(salt):
    """The engine's cache salt is the tenant's group and the request's salt as a JSON pair: no salt sent
    by a shared-group key or another tenant equals tenant beta's, with or without its own salt."""
    beta = Tenant("beta")
    for other in (Tenant("a"), Tenant("shared", prefix_cache_group=""), Tenant("g", prefix_cache_group="beta2")):
        assert other.cache_salt(salt) not in (beta.cache_salt(None), beta.cache_salt(""), beta.cache_salt("x"))
    assert Tenant("shared", prefix_cache_group="").cache_salt(None) is None  # the server's default cache
