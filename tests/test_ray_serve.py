"""Ray Serve on CPU: a local cluster (2 CPUs), 2 replicas of a tiny model behind the ingress; the
openai client streams through it and greedy outputs equal one server's."""

from __future__ import annotations

import os
import socket

import httpx
import openai
import pytest
from serve_helpers import ENGINE_DEFAULTS
from server_helpers import MODEL_NAME, running_server

from serve import EngineArgs

PROMPTS = [[5, 6, 7, 8] * 6 + [i] for i in range(4)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _greedy(client: openai.OpenAI) -> list[str]:
    texts = []
    for p in PROMPTS:
        stream = client.completions.create(
            model=MODEL_NAME, prompt=p, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        texts.append("".join(c.choices[0].text for c in stream if c.choices))
    return texts


@pytest.mark.slow
def test_two_replicas_stream_the_single_servers_greedy_outputs():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from serve.ray_app import build_ray_app

    args = EngineArgs(**{**ENGINE_DEFAULTS, "max_model_len": 128})
    with running_server(max_model_len=128) as (url, _):
        expected = _greedy(openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0))

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_ray_app(args, 2, {"model_name": MODEL_NAME}, warmup=False, cpus_per_replica=0.5)
        serve.run(app, name="jaxinfra", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        health = httpx.get(f"{base}/health", timeout=30)
        assert health.status_code == 200, health.text
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        assert _greedy(client) == expected
        bad = httpx.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400 and "error" in bad.json()  # the replica's own OpenAI error
    finally:
        serve.shutdown()
        ray.shutdown()


def test_replicas_need_ray(capsys):
    from serve.http.main import main

    assert main(["--replicas", "2", "--model", "tiny-qwen3"]) == 2
    assert "--replicas must be 1" in capsys.readouterr().err
