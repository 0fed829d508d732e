"""Ray Serve on CPU, one local cluster (2 CPUs) for the module: replicas of a tiny model behind the
ingress. The openai client streams through it and greedy outputs equal one server's; a replica
killed mid-load loses no request that had not started answering; a burst raises the replica count
under the SLO policy and a quiet spell brings it back down."""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from serve import EngineArgs
from serve.http.tool_parsers import ToolConfig
from serve.scale.autoscale import AutoscaleConfig
from serve.scale.autoscale_args import PoolConfig
from tests.serve_helpers import ENGINE_DEFAULTS
from tests.server_helpers import MODEL_NAME, running_server

PROMPTS = [[5, 6, 7, 8] * 6 + [i] for i in range(4)]
LONG = 64  # tokens per request under load: long enough to be in flight when a replica is killed
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(client: openai.OpenAI, prompt: list[int], max_tokens: int, stream: bool) -> str:
    kwargs = dict(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def _pool(base: str) -> dict:
    return httpx.get(f"{base}/ray/replicas", timeout=30).json()


def _wait_for(base: str, ready: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while (status := _pool(base))["desired"] != ready or len(status["ready"]) != ready or status["draining"]:
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    return status


@pytest.fixture(scope="module")
def expected():
    """One server's greedy outputs: 8 tokens of each prompt, and LONG tokens."""
    with running_server(max_model_len=128) as (url, _):
        client = _client(url)
        short = [_complete(client, p, 8, stream=True) for p in PROMPTS]
        long = [_complete(client, p, LONG, stream=False) for p in PROMPTS]
    return short, long


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray Serve kills an HTTP proxy not ready in 5 s (three tries): a 2-core machine busy with the other
    # tests can take longer to import one. The cluster's processes inherit these.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    import ray
    from ray import serve

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


DEPLOYED: dict[str, str] = {}  # the app now on the module's cluster


def deploy(name: str, replicas: int, autoscale: AutoscaleConfig, **spec_kwargs) -> None:
    """Puts `replicas` engine replicas under `autoscale` (fast polls) on the cluster, unless the app
    called `name` is already there (tests share it in any order)."""
    from ray import serve

    from serve.scale.ray_app import ReplicaSpec, build_ray_app

    if DEPLOYED.get("app") == name:
        return
    # replicas share the run's compilation cache as one machine's replicas would: a replacement or an added
    # replica loads the step shapes the first ones (and the `expected` server, of the same layout) compiled
    args = EngineArgs(**{**ENGINE_DEFAULTS, "max_model_len": 128})
    spec = ReplicaSpec(args, {"model_name": MODEL_NAME}, warmup=False, cpus=0.5, **spec_kwargs)
    pool = PoolConfig(autoscale, metrics_interval_s=0.2, look_back_period_s=2.0, drain_timeout_s=30.0)
    serve.run(build_ray_app(spec, replicas, pool), name="jaxinfra", route_prefix="/")
    DEPLOYED["app"] = name


def deploy_two() -> None:
    """Two fixed replicas, with a metric prefix and tool calling on, as `jaxinfra serve --ray` passes them."""
    deploy(
        "two",
        2,
        AutoscaleConfig(min_replicas=2, max_replicas=2),
        metrics_prefix="jx_ray",
        tools=ToolConfig("hermes", enable_auto_tool_choice=True),
    )


@pytest.mark.slow
def test_two_replicas_stream_the_single_servers_greedy_outputs(cluster, expected):
    deploy_two()
    assert len(_wait_for(cluster, 2)["ready"]) == 2
    assert httpx.get(f"{cluster}/health", timeout=30).status_code == 200
    client = _client(cluster)
    assert [_complete(client, p, 8, stream=True) for p in PROMPTS] == expected[0]
    bad = httpx.post(f"{cluster}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and "error" in bad.json()  # the replica's own OpenAI error
    # the replicas got --metrics-prefix and the tool-call flags
    assert "jx_ray:time_to_first_token_seconds" in httpx.get(f"{cluster}/metrics", timeout=30).text
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="auto", max_tokens=4
    )
    assert chat.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.slow
def test_a_killed_replica_loses_no_request_that_had_not_started(cluster, expected):
    import ray

    from serve.scale.ray_app import REPLICA_NAMESPACE

    deploy_two()
    _wait_for(cluster, 2)
    client = _client(cluster)
    jobs = [(PROMPTS[i % 4], False) for i in range(6)] + [(PROMPTS[0], True), (PROMPTS[1], True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(_complete, client, p, LONG, s) for p, s in jobs]
        deadline = time.monotonic() + 60
        while not (busy := [r for r in _pool(cluster)["ready"] if r["in_flight"] >= 2]):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        ray.kill(ray.get_actor(busy[0]["name"], namespace=REPLICA_NAMESPACE))
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result(timeout=180))
            except openai.APIError as e:  # only a stream already answering may end in an error
                outcomes.append(e)
    for (prompt, stream), outcome in zip(jobs, outcomes, strict=True):
        if not stream or not isinstance(outcome, openai.APIError):
            assert outcome == expected[1][PROMPTS.index(prompt)], (stream, outcome)
    status = _pool(cluster)
    assert status["retried"] >= 1 and busy[0]["name"] not in [r["name"] for r in status["ready"]]
    # being replaced: a replacement that fails to start (a transient Ray error) is retried on the next
    # control step, so the count is polled rather than read once
    deadline = time.monotonic() + 60
    while not ((status := _pool(cluster))["desired"] == 2 and len(status["ready"]) + status["starting"] == 2):
        assert time.monotonic() < deadline, status
        time.sleep(0.2)


@pytest.mark.slow
def test_a_burst_scales_up_and_quiet_scales_back_down(cluster, expected):
    # tiny targets: any request's TTFT misses the SLO, so a burst of half a second trips the policy
    slo = AutoscaleConfig(
        min_replicas=1, max_replicas=2, ttft_p95_target_s=1e-4, upscale_delay_s=0.5, downscale_delay_s=1.0
    )
    deploy("burst", 1, slo)
    assert _wait_for(cluster, 1)["ready"]
    client = _client(cluster)
    deadline = time.monotonic() + 300  # the added replica compiles first: minutes on a loaded 2-core machine
    with ThreadPoolExecutor(4) as pool:  # the burst lasts until the added replica is up
        while len(_pool(cluster)["ready"]) < 2:
            assert time.monotonic() < deadline
            assert list(pool.map(lambda p: _complete(client, p, 8, stream=True), PROMPTS)) == expected[0]
    assert _pool(cluster)["desired"] == 2
    _wait_for(cluster, 1)  # no requests: quiet, so one replica is drained and removed


def test_replicas_need_ray(capsys):
    from serve.http.main import main

    assert main(["--replicas", "2", "--model", "tiny-qwen3"]) == 2
    assert "--replicas must be 1" in capsys.readouterr().err


def test_bad_autoscaling_flags_name_the_flag(capsys):
    from serve.http.main import main

    assert main(["--ray", "--replicas", "2", "--min-replicas", "3", "--max-replicas", "2"]) == 2
    assert "argument --min-replicas (3) must be >= 1 and <= max_replicas" in capsys.readouterr().err
    assert main(["--ray", "--metrics-interval-s", "0"]) == 2
    assert "argument --metrics-interval-s must be > 0" in capsys.readouterr().err
