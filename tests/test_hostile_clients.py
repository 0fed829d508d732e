"""Hostile clients and tenants against one server with a keys file: no request can end the engine core
or the server, beam search is admitted like any call, and no tenant can read another's data."""

from __future__ import annotations

import threading

import httpx
import msgspec
import pytest

from serve.core.core_proc import decode_input
from serve.http.tenants import Tenant
from serve.sampling_params import SamplingParams
from serve.types import EngineCoreOutputs, EngineCoreRequest
from tests.server_helpers import MODEL_NAME, core_stats, eventually, running_server

TENANTS = {
    b"alpha": Tenant("alpha"),
    b"beta": Tenant("beta"),
    b"limited": Tenant("limited", max_concurrent=2, tokens_per_minute=300),
    b"flood": Tenant("flood", requests_per_minute=1),
}
KEYS = {name.decode(): f"sk-{name.decode()}-key" for name in TENANTS}
OPERATOR = "sk-operator-key"


@pytest.fixture(scope="module")
def server():
    from serve.http.auth import key_digest

    keys = {key_digest(KEYS[n.decode()]): t for n, t in TENANTS.items()}
    with running_server(api_key=OPERATOR, api_keys=keys, max_queue=16, max_num_seqs=8) as (url, app):
        yield url, app


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS.get(tenant, OPERATOR)}"}


def complete(url: str, tenant: str = "alpha", timeout: float = 120, **body) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, headers=auth(tenant), timeout=timeout)


def core_pid(app) -> int:
    return app.state.server.engine.core.proc.pid


WRONG = [1, 2.5, "yes", True, [], ["a", 1], {}, {"a": 1}]
STRUCTURED_TYPES = {
    "json": (dict, str),
    "json_object": (bool,),
    "regex": (str,),
    "choice": (list,),
    "grammar": (str,),
    "additional_properties": (bool,),
}


def test_structured_output_fields_of_every_wrong_type_are_400s_and_the_core_lives(server):
    """Every structured_outputs field with every JSON type it does not take (a string `choice` once
    killed the core) is a 400 naming structured_outputs; the core process is the same one after."""
    url, app = server
    pid = core_pid(app)
    sent = 0
    for field, types in STRUCTURED_TYPES.items():
        for value in WRONG:
            if isinstance(value, types):  # bool is no dict, str or list: only the bool fields take it
                continue
            so = {field: value} if field != "additional_properties" else {"json": {"type": "object"}, field: value}
            r = complete(url, structured_outputs=so)
            assert r.status_code == 400, (so, r.text)
            assert r.json()["error"]["param"] == "structured_outputs", r.text
            sent += 1
    for field, value in (("guided_choice", "x"), ("guided_json", 5), ("guided_regex", 1), ("guided_grammar", [])):
        assert complete(url, **{field: value}).status_code == 400, field
    assert sent >= 30
    assert complete(url, structured_outputs={"choice": ["yes", "no"]}).json()["choices"][0]["text"] in ("yes", "no")
    assert core_pid(app) == pid and app.state.server.engine.healthy


def test_core_refuses_a_request_it_cannot_decode_and_goes_on():
    """A request whose fields do not decode as their types fails alone (its id in `rejected`); a frame
    that is not a message at all is dropped. Neither raises."""
    good = msgspec.msgpack.encode(EngineCoreRequest("ok", [1, 2], SamplingParams(max_tokens=2), 0, 0.0))
    raw = msgspec.msgpack.decode(good)
    raw[1] = "bad"
    raw[3]["structured_outputs"] = {"choice": "x"}
    decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
    reply = EngineCoreOutputs()
    assert decode_input(decoder, msgspec.msgpack.encode(raw), reply) is None
    assert reply.rejected[0][0] == "bad" and "choice" in reply.rejected[0][1]
    assert decode_input(decoder, b"\xc1 not msgpack", reply) is None and len(reply.rejected) == 1
    assert decode_input(decoder, good, reply).request_id == "ok"


def chained_grammar(rules: int) -> str:
    """A Lark grammar of `rules` rules, each calling the next: thousands overflow llguidance's stack."""
    return "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(rules)) + f'r{rules}: "b"\n'


def test_a_grammar_that_crashes_its_checker_fails_only_that_request(server):
    """A 3,000-rule chained grammar (55 KB) crashes the checker's child (it once segfaulted the whole
    server): a 400 for it, a stream beside it finishes, and the next grammar is checked by a new child."""
    url, app = server
    pid = core_pid(app)
    beside: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: beside.append(complete(url, "beta", max_tokens=64, ignore_eos=True)))
    worker.start()
    r = complete(url, guided_grammar=chained_grammar(3000))
    assert r.status_code == 400 and "crashed" in r.json()["error"]["message"], r.text
    ok = complete(url, guided_grammar=chained_grammar(20), max_tokens=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "a" * 20 + "b", ok.text
    worker.join(120)
    assert beside[0].status_code == 200 and beside[0].json()["usage"]["completion_tokens"] == 64
    assert core_pid(app) == pid


def test_beam_search_is_admitted_like_any_call(server):
    """Beam search counts best_of sequences per prompt against the server's capacity and the tenant's
    max_concurrent (it once put 757 sequences against a cap of 24 and escaped quotas)."""
    url, _ = server
    beams = {"use_beam_search": True, "max_tokens": 3}
    r = complete(url, prompt=["a b", "c d", "e f", "g h"], best_of=8, **beams)
    assert r.status_code == 400 and "can never run" in r.json()["error"]["message"], r.text  # 32 of 24
    r = complete(url, "limited", best_of=3, **beams)
    assert r.status_code == 400 and "tenant 'limited' may run 2" in r.json()["error"]["message"], r.text
    r = complete(url, "limited", best_of=2, **beams)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text


def test_an_abandoned_beam_search_stops(server):
    """A client that leaves a beam search frees its sequences at once: nothing stays in flight or runs."""
    url, app = server
    state = app.state.server
    with pytest.raises(httpx.ReadTimeout):
        complete(url, "beta", timeout=1.5, use_beam_search=True, best_of=4, max_tokens=200, ignore_eos=True)
    assert eventually(lambda: state.in_flight == 0, timeout=10), state.in_flight
    assert eventually(lambda: core_stats(app).num_running == 0, timeout=10)


def test_tenant_concurrency_counts_sequences(server):
    """n counts: a call of n=3 from a tenant limited to 2 sequences can never run (400), n=2 runs."""
    url, _ = server
    r = complete(url, "limited", n=3, temperature=1)
    assert r.status_code == 400 and "needs 3 sequences" in r.json()["error"]["message"], r.text
    assert complete(url, "limited", n=2, temperature=1).status_code == 200


def test_tokens_per_minute_reserve_max_tokens(server):
    """A call whose prompt and max_tokens can never fit the tenant's tokens per minute is a 400 at once."""
    url, _ = server
    r = complete(url, "limited", max_tokens=200, n=2, temperature=1)  # 400 + the prompt > 300
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], r.text


def respond(url: str, tenant: str, **body) -> httpx.Response:
    body = {"model": MODEL_NAME, "input": "Say something", "max_output_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/responses", json=body, headers=auth(tenant), timeout=120)


def test_stored_responses_belong_to_their_tenant(server):
    """Tenant beta can neither read alpha's stored response nor continue it; alpha can do both."""
    url, _ = server
    made = respond(url, "alpha")
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    assert httpx.get(f"{url}/v1/responses/{rid}", headers=auth("beta")).status_code == 404
    stolen = respond(url, "beta", previous_response_id=rid)
    assert stolen.status_code == 404 and stolen.json()["error"]["param"] == "previous_response_id"
    assert httpx.get(f"{url}/v1/responses/{rid}", headers=auth("alpha")).json()["id"] == rid
    assert respond(url, "alpha", previous_response_id=rid).status_code == 200


def test_status_shows_a_tenant_only_its_own_rows(server):
    url, _ = server
    complete(url, "beta")
    mine = httpx.get(f"{url}/status", headers=auth("beta")).json()
    assert set(mine["tenants"]) == {"beta"}
    assert all(r["tenant"] == "beta" for r in mine["slowest_requests"])
    everyone = httpx.get(f"{url}/status", headers=auth("operator")).json()
    assert {"alpha", "beta", "limited"} <= set(everyone["tenants"])


def test_a_cache_salt_cannot_join_another_tenants_prefix_cache(server):
    """Beta's prompt is cached; alpha sending the salt that once spelled beta's cache key finds no hit."""
    url, app = server
    prompt = [5 + (i % 50) for i in range(96)]
    assert complete(url, "beta", prompt=prompt, max_tokens=1).status_code == 200
    before = core_stats(app).prefix_cache_hits
    for salt in ("tenant:beta\u0000", '["beta", null]', "beta"):
        assert complete(url, "alpha", prompt=prompt, max_tokens=1, cache_salt=salt).status_code == 200
    assert core_stats(app).prefix_cache_hits == before  # counted when scheduled, before each answer
    complete(url, "beta", prompt=prompt, max_tokens=1)
    assert eventually(lambda: core_stats(app).prefix_cache_hits > before)  # beta itself still hits


def test_a_tenant_over_its_quota_is_refused_before_its_body_is_read(server):
    """Once over its requests per minute, a tenant's calls get their 429 (with Retry-After) before the
    body is parsed: a body that is not even JSON gets the 429, not a 400; its other routes still work."""
    url, _ = server
    assert complete(url, "flood").status_code == 200
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        r = httpx.post(f"{url}{path}", content=b"{not json", headers=auth("flood"))
        assert r.status_code == 429 and int(r.headers["Retry-After"]) > 0, (path, r.text)
        assert r.json()["error"]["code"] == "quota_exceeded"
    assert httpx.get(f"{url}/v1/models", headers=auth("flood")).status_code == 200
    assert httpx.get(f"{url}/status", headers=auth("flood")).json()["tenants"]["flood"]["refused"] == 3
