"""Multi-LoRA over HTTP: a request's `model` picks an adapter (--lora-modules, or loaded at run time) and
answers as the offline LLM with that LoRARequest; /v1/models lists the adapters; the operator's load and
unload routes work while other adapters' streams run, a stream of an adapter being unloaded finishes with
it, and bad adapters, names and keys get 4xx answers that name them."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading

import httpx
import openai
import pytest

from serve import LLM, EngineArgs, LoRARequest, SamplingParams
from serve.engine.async_engine import AsyncEngine
from serve.http.app import build_app
from serve.http.auth import key_digest
from serve.http.cli_args import build_parser, engine_args_from
from serve.http.lora_modules import LoRAModulePath, parse_lora_module
from serve.http.main import main
from serve.http.tenants import Tenant
from tests.lora_helpers import ATTENTION, save_adapter
from tests.serve_helpers import ENGINE_DEFAULTS, PRESET, prompts
from tests.server_helpers import MODEL_NAME, call, eventually, serve_in_thread

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

# KV for the four long streams at once (no preemption), three adapter slots
LORA_ARGS = dict(enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=4, num_gpu_blocks_override=160)
KEY, USER_KEY = "operator-key", "user-key"
SHORT, LONG = 8, 200  # tokens: answers, and the streams that run while adapters come and go
EXTRA = {"ignore_eos": True, "return_token_ids": True}
PROMPTS = prompts([12, 20, 7], seed=3)
RANKS = {"sql": 4, "chat": 8, "doomed": 2, "late": 6, "extra": 8}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    """Adapter folders by name; "big" has rank 16, above the server's --max-lora-rank 8."""
    root = tmp_path_factory.mktemp("lora_http")
    for seed, (name, rank) in enumerate(RANKS.items(), start=1):
        save_adapter(root / name, seed, rank)
    save_adapter(root / "big", 9, 16, ATTENTION)
    return {name: str(root / name) for name in [*RANKS, "big"]}


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(**{**ENGINE_DEFAULTS, **LORA_ARGS})


def reference(llm: LLM, adapters: dict[str, str], name: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The offline LLM's greedy tokens with adapter `name` (the served model's name: none)."""
    lora = None if name == MODEL_NAME else LoRARequest(name, list(RANKS).index(name) + 1, adapters[name])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def server(adapters):
    """(url, app): the tiny model with "sql", "chat" (vLLM's JSON form, its own base name) and "doomed"
    served from the start; the operator's key, and a user tenant's."""
    modules = [
        LoRAModulePath("sql", adapters["sql"]),
        parse_lora_module(json.dumps({"name": "chat", "path": adapters["chat"], "base_model_name": "tiny-base"})),
        parse_lora_module(f"doomed={adapters['doomed']}"),
    ]
    engine = AsyncEngine(EngineArgs(**{**ENGINE_DEFAULTS, **LORA_ARGS}), warmup=False)
    app = build_app(
        engine,
        model_name=MODEL_NAME,
        api_key=KEY,
        api_keys={key_digest(USER_KEY): Tenant("user")},
        request_timeout=120,
        lora_modules=modules,
    )
    with serve_in_thread(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)


def admin(url: str, route: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/{route}", json=body, headers=headers, timeout=60)


def complete(client: openai.OpenAI, model: str, prompt: list[int], max_tokens: int = SHORT) -> list[int]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=EXTRA)
    assert out.model == model
    return out.choices[0].token_ids


def test_model_field_selects_the_adapter_as_offline(client, offline, adapters):
    got = {name: complete(client, name, PROMPTS[0]) for name in ("sql", "chat", MODEL_NAME)}
    for name, tokens in got.items():
        assert tokens == reference(offline, adapters, name, PROMPTS[0], SHORT), name
    assert len({tuple(t) for t in got.values()}) == 3  # the adapters change the answer
    chat = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "Hi there"}],
        max_tokens=SHORT,
        temperature=0,
        extra_body=EXTRA,
    )
    assert chat.model == "chat"
    prompt_ids = chat.prompt_token_ids
    assert chat.choices[0].token_ids == reference(offline, adapters, "chat", prompt_ids, SHORT)
    assert client.responses.create(model="sql", input="Hi", max_output_tokens=4).model == "sql"


def served(client: openai.OpenAI) -> list[str]:
    """/v1/models' ids: the base model, then the adapters (in the order loaded; the tests run in any order,
    each leaving the three of --lora-modules served, so callers compare the adapters as a set)."""
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == MODEL_NAME
    return ids[1:]


def test_models_lists_the_adapters(server, client, adapters):
    assert set(served(client)) == {"sql", "chat", "doomed"}
    cards = {m["id"]: m for m in httpx.get(f"{server[0]}/v1/models", headers={"x-api-key": KEY}).json()["data"]}
    assert cards["sql"]["root"] == adapters["sql"] and cards["sql"]["parent"] == MODEL_NAME
    assert cards["chat"]["root"] == adapters["chat"] and cards["chat"]["parent"] == "tiny-base"
    assert cards[MODEL_NAME]["parent"] is None


def test_unknown_model_is_a_404_naming_it(client):
    with pytest.raises(openai.NotFoundError, match="The model 'no-such-adapter' does not exist"):
        client.completions.create(model="no-such-adapter", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="'no-such-chat' does not exist"):
        client.chat.completions.create(model="no-such-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)


def test_load_and_unload_at_run_time(server, client, offline, adapters):
    url, app = server
    loaded = admin(url, "load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]})
    assert loaded.status_code == 200, loaded.text
    assert "late" in served(client)
    assert complete(client, "late", PROMPTS[1]) == reference(offline, adapters, "late", PROMPTS[1], SHORT)
    lora_id = app.state.server.loras.get("late").lora_int_id
    assert lora_id in call(app, "list_loras")

    errors = [
        ({"lora_name": "late", "lora_path": adapters["late"]}, "The lora adapter 'late' has already been loaded"),
        (
            {"lora_name": "big", "lora_path": adapters["big"]},
            r"'big' has rank 16, above the engine's max_lora_rank \(8\)",
        ),
        ({"lora_name": "ghost", "lora_path": "/nonexistent/adapter"}, "LoRA adapter 'ghost': .*not a PEFT adapter"),
        ({"lora_name": "nopath"}, "lora_path must be a non-empty string"),
        ({"lora_name": MODEL_NAME, "lora_path": adapters["late"]}, "is the base model's name"),
    ]
    for body, message in errors:
        r = admin(url, "load_lora_adapter", body)
        assert r.status_code == 400, body
        assert re.search(message, r.json()["error"]["message"]), (body, r.json())
    assert set(served(client)) == {"sql", "chat", "doomed", "late"}

    assert admin(url, "unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="'late' does not exist"):
        complete(client, "late", PROMPTS[1])
    assert "late" not in served(client)
    assert lora_id not in call(app, "list_loras")  # nothing ran with it: forgotten at once
    again = admin(url, "unload_lora_adapter", {"lora_name": "late"})
    assert again.status_code == 404 and again.json()["error"]["message"] == "The lora adapter 'late' cannot be found."


def test_the_admin_routes_need_the_operators_key(server, client):
    url, _ = server
    for route, body in (
        ("load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}),
        ("unload_lora_adapter", {"lora_name": "sql"}),
    ):
        assert admin(url, route, body, key=None).status_code == 401
        assert admin(url, route, body, key="wrong").status_code == 401
        r = admin(url, route, body, key=USER_KEY)
        assert r.status_code == 403 and "operator" in r.json()["error"]["message"]
    user = openai.OpenAI(base_url=f"{url}/v1", api_key=USER_KEY, max_retries=0)
    assert complete(user, "sql", PROMPTS[2]) == complete(client, "sql", PROMPTS[2])  # "sql" is still served


def test_load_and_unload_under_load(server, client, offline, adapters):
    """Streams of two adapters, the base model and "doomed" run while "extra" is loaded and "doomed"
    unloaded: every stream gives its whole offline answer, "doomed"'s included (requests already sent
    finish with their adapter), and the core forgets "doomed" once its stream is over; it can be loaded
    again (as the other tests expect it)."""
    url, app = server
    jobs = [("sql", 0), ("doomed", 1), (MODEL_NAME, 2), ("chat", 1)]
    started = [threading.Event() for _ in jobs]

    def stream(i: int) -> list[int]:
        name, p = jobs[i]
        tokens: list[int] = []
        chunks = client.completions.create(
            model=name, prompt=PROMPTS[p], max_tokens=LONG, temperature=0, stream=True, extra_body=EXTRA
        )
        for chunk in chunks:
            for choice in chunk.choices:
                tokens += getattr(choice, "token_ids", None) or []
            started[i].set()
        return tokens

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(stream, i) for i in range(len(jobs))]
        assert all(e.wait(120) for e in started)
        doomed = app.state.server.loras.get("doomed").lora_int_id
        assert not futures[1].done()
        assert admin(url, "unload_lora_adapter", {"lora_name": "doomed"}).status_code == 200
        assert doomed in call(app, "list_loras")  # its stream still runs with it
        assert (
            admin(url, "load_lora_adapter", {"lora_name": "extra", "lora_path": adapters["extra"]}).status_code == 200
        )
        assert complete(client, "extra", PROMPTS[0]) == reference(offline, adapters, "extra", PROMPTS[0], SHORT)
        with pytest.raises(openai.NotFoundError, match="'doomed' does not exist"):
            complete(client, "doomed", PROMPTS[0])
        results = [f.result(timeout=300) for f in futures]
    for (name, p), tokens in zip(jobs, results):
        assert tokens == reference(offline, adapters, name, PROMPTS[p], LONG), name
    assert eventually(lambda: doomed not in call(app, "list_loras"))
    assert admin(url, "unload_lora_adapter", {"lora_name": "extra"}).status_code == 200
    assert admin(url, "load_lora_adapter", {"lora_name": "doomed", "lora_path": adapters["doomed"]}).status_code == 200
    assert complete(client, "doomed", PROMPTS[1]) == reference(offline, adapters, "doomed", PROMPTS[1], SHORT)


def test_a_server_refuses_adapters_outside_its_target_modules(adapters, tmp_path):
    save_adapter(tmp_path / "qv", 11, 4, ("q_proj", "v_proj"))
    args = EngineArgs(**{**ENGINE_DEFAULTS, **LORA_ARGS, "lora_target_modules": "q_proj,v_proj"})
    app = build_app(AsyncEngine(args, warmup=False), model_name=MODEL_NAME, api_key=KEY)
    with serve_in_thread(app) as url:
        r = admin(url, "load_lora_adapter", {"lora_name": "sql", "lora_path": adapters["sql"]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == (
            "LoRA adapter 'sql' wraps k_proj, o_proj, gate_proj, up_proj, down_proj, outside the engine's "
            "lora_target_modules (--lora-target-modules q_proj,v_proj)"
        )
        assert (
            admin(url, "load_lora_adapter", {"lora_name": "qv", "lora_path": str(tmp_path / "qv")}).status_code == 200
        )
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert len(complete(client, "qv", PROMPTS[0])) == SHORT


def test_lora_module_flags(capsys):
    argv = [
        "--enable-lora",
        "--max-loras",
        "4",
        "--lora-modules",
        "a=/x",
        '{"name": "b", "path": "/y", "base_model_name": "m"}',
    ]
    args = build_parser().parse_intermixed_args([*argv, "--max-lora-rank", "8", "--max-cpu-loras", "6"])
    assert args.lora_modules == [LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y", "m")]
    engine = engine_args_from(args)
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == (True, 4, 8, 6)
    assert len(engine.lora_modules()) == 7  # default: all
    targets = build_parser().parse_intermixed_args(["--lora-target-modules", "v_proj,q_proj"])
    assert engine_args_from(targets).lora_modules() == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match=r"argument --lora-target-modules: unknown or no module\(s\) \['qkv'\]"):
        engine_args_from(build_parser().parse_intermixed_args(["--lora-target-modules", "q_proj,qkv"]))
    for bad, why in (("nameonly", "must be name=path or a JSON object"), ('{"name": "b"}', "must have name and path")):
        with pytest.raises(SystemExit):
            build_parser().parse_intermixed_args(["--lora-modules", bad])
        assert f"argument --lora-modules: {bad!r} {why}" in capsys.readouterr().err
    assert main(["--model", PRESET, "--lora-modules", "a=/x"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
