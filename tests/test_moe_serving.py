"""Serving mixture-of-experts models: expert parallelism (experts split over devices, tokens sent to
them by all-to-all) gives the one-device engine's greedy tokens; bad parallel sizes are errors naming
the field; each expert's load reaches /metrics, /status and the dashboard."""

import json

import httpx
import pytest
from flax import nnx

import jaxinfra
from jaxinfra.models import LlamaModel
from serve import EngineArgs, LLMEngine
from serve.http.cli_args import build_parser, engine_args_from
from tests.check_scripts import run_check
from tests.headless_chromium import chromium_path, open_page
from tests.server_helpers import MODEL_NAME, eventually, metric, running_server

PROMPTS = [[7, 8, 9, 10, 11], list(range(100, 123)), [300 + i for i in range(9)]]
MAX_TOKENS = 6


@pytest.mark.slow
def test_expert_parallel_serving_matches_one_device():
    out = run_check("tests.sharding.ep_serving_check", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    one, wide = r["one"], r["wide"]
    assert wide["tokens"] == one["tokens"]
    assert wide["load"] == one["load"]  # the same routing; padding tokens not counted
    fed = (5 + 23 + 9) + 3 * (6 - 1)  # every prompt token, and each sampled token but the last
    assert [sum(layer) for layer in one["load"]] == [fed * 2] * 2  # x top-2, in each of the 2 MoE layers
    assert one["gate_shard"] == [4, 64, 96] and one["devices"] == 1
    assert wide["gate_shard"] == [1, 64, 96] and wide["devices"] == 4  # one whole expert a device


def test_bad_expert_parallel_sizes_are_errors_naming_the_field():
    with pytest.raises(ValueError, match=r"EngineArgs.expert_parallel_size must be a multiple of tensor_parallel"):
        EngineArgs(tensor_parallel_size=2, expert_parallel_size=3)
    with pytest.raises(ValueError, match=r"EngineArgs.expert_parallel_size must be 1 or tensor_parallel_size"):
        EngineArgs(tensor_parallel_size=2, expert_parallel_size=4, enable_expert_parallel=True)
    small = dict(max_model_len=64, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match=r"EngineArgs.expert_parallel_size \(3\) must divide the model's num_experts"):
        LLMEngine(abstract_model("tiny-mixtral"), None, EngineArgs(expert_parallel_size=3, **small))
    with pytest.raises(ValueError, match=r"EngineArgs.expert_parallel_size \(2\) needs a mixture-of-experts model"):
        LLMEngine(abstract_model("tiny-qwen3"), None, EngineArgs(expert_parallel_size=2, **small))
    args = engine_args_from(build_parser().parse_args(["--tensor-parallel-size", "2", "--enable-expert-parallel"]))
    assert args.enable_expert_parallel and args.expert_parallel() == 2


@pytest.fixture(scope="module")
def moe_server():
    """A tiny Mixtral server; decodes run in 4-step device loops (counted there too), no prefix cache."""
    small = dict(max_num_seqs=2, max_num_batched_tokens=16, num_scheduler_steps=4)
    with running_server(model="tiny-mixtral", enable_prefix_caching=False, **small) as (url, app):
        yield url, app


def test_expert_load_on_metrics_status_and_dashboard(moe_server):
    url, _ = moe_server
    before = {layer: layer_tokens(url, layer) for layer in ("0", "1")}
    for prompt in PROMPTS:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
    fed = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (MAX_TOKENS - 1)  # the last sampled token is never fed
    routed = lambda: {layer: layer_tokens(url, layer) - before[layer] for layer in before}
    assert eventually(lambda: routed() == {"0": 2 * fed, "1": 2 * fed}), routed()  # each fed token to top-2
    assert metric(url, "jaxinfra:moe_expert_load_imbalance", model_name=MODEL_NAME) >= 1.0
    load = httpx.get(f"{url}/status").json()["expert_load"]
    assert len(load["tokens_per_expert"]) == 4 and load["imbalance"] >= 1.0
    assert sum(load["tokens_per_expert"]) == sum(layer_tokens(url, layer) for layer in ("0", "1"))
    assert chromium_path() is not None, "the dashboard test needs Debian's chromium (.ci/run installs it)"
    with open_page(f"{url}/dashboard") as page:
        page.wait_for("Number(document.body.dataset.updates) >= 1")
        assert page.evaluate("document.getElementById('experts-section').hidden") is False
        assert page.evaluate("document.querySelectorAll('#experts tr').length") == 1 + 4


def abstract_model(preset: str) -> LlamaModel:
    """A preset's model with shapes but no weights (the engine refuses it before touching any)."""
    return nnx.eval_shape(lambda: LlamaModel(jaxinfra.load_config(preset), nnx.Rngs(0)))


def layer_tokens(url: str, layer: str) -> float:
    """Token copies an MoE layer routed, summed over its 4 experts (from /metrics)."""
    return sum(
        metric(url, "jaxinfra:moe_expert_tokens_total", model_name=MODEL_NAME, layer=layer, expert=str(e))
        for e in range(4)
    )
