"""Live weight updates for RL loops: after `LLM.update_weights` (a model, or a trainer's stacked
float32 params) or the server's POST /update_weights_from_disk, greedy outputs equal a fresh engine
built from the new weights, prefix cache included; wrong shapes are an error naming the weight; a
busy engine refuses (409 on HTTP); only an operator's key may update."""

import threading

import httpx
import jax
import numpy as np
import pytest
from flax import nnx

import jaxinfra
from jaxinfra.models.llama import stack_layers
from serve import LLM, SamplingParams
from serve.core.engine_core import EngineBusy
from serve.http.auth import key_digest
from serve.http.tenants import Tenant
from tests.hf_oracle import make_hf_model, save_hf_model
from tests.server_helpers import MODEL_NAME, running_server, stream_body

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

ENGINE = dict(max_model_len=64, block_size=8, max_num_seqs=4, num_gpu_blocks_override=64)
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 9, 10, 11], [5, 17, 99, 3, 42, 7, 8, 9, 60, 61, 62]]  # a shared prefix
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two random checkpoints of one shape (seeds 0 and 1), with a tokenizer."""
    paths = []
    for seed in (0, 1):
        path = save_hf_model(make_hf_model("llama3_rope_scaling", seed=seed), tmp_path_factory.mktemp(f"w{seed}"))
        jaxinfra.load_tokenizer("tiny-llama").save(path)
        paths.append(str(path))
    return paths


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_update_weights_gives_a_fresh_engines_outputs(checkpoints):
    old, new = checkpoints
    want_new, want_old = greedy(LLM(new, **ENGINE)), greedy(LLM(old, **ENGINE))
    assert want_new != want_old
    llm = LLM(old, **ENGINE)
    assert greedy(llm) == want_old  # the prompts' blocks are now in the prefix cache
    llm.update_weights(jaxinfra.load_model(new))
    assert greedy(llm) == want_new
    # back, from a trainer's layout: float32 masters, decoder layers stacked [L, ...], as TrainState.params
    trained = stack_layers(nnx.to_pure_dict(nnx.state(jaxinfra.load_model(old), nnx.Param)))
    llm.update_weights(type("TrainState", (), {"params": jax.tree.map(np.asarray, trained)})())
    assert greedy(llm) == want_old


def test_weights_of_another_shape_are_refused_naming_the_weight(checkpoints):
    llm = LLM(checkpoints[0], **ENGINE)
    other = jaxinfra.load_model(
        save_hf_model(make_hf_model("llama3_rope_scaling", vocab_size=320), checkpoints[0] + "-big")
    )
    with pytest.raises(ValueError, match=r"weight \['embed'\]: shape \(320, 64\), the engine's is \(300, 64\)"):
        llm.update_weights(other)
    with pytest.raises(ValueError, match="update_weights takes a model"):
        llm.update_weights([1, 2])


def test_a_busy_engine_refuses_an_update(checkpoints):
    llm = LLM(checkpoints[0], **ENGINE)
    llm.engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(EngineBusy, match="1 requests are in flight"):
        llm.update_weights(jaxinfra.load_model(checkpoints[1]))


def test_update_weights_from_disk_over_http(checkpoints):
    old, new = checkpoints
    want = greedy(LLM(new, **ENGINE))
    operator, tenant = "sk-op", "sk-tenant"
    keys = {key_digest(tenant): Tenant("t")}
    with running_server(api_key=operator, api_keys=keys, model=old, tokenizer=old, **ENGINE) as (url, _):

        def post(key: str | None, body: dict) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.post(f"{url}/update_weights_from_disk", json=body, headers=headers, timeout=120)

        def completions() -> list[list[int]]:
            body = {"model": MODEL_NAME, "prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            r = httpx.post(
                f"{url}/v1/completions",
                json={**body, "return_token_ids": True},
                timeout=60,
                headers={"Authorization": f"Bearer {operator}"},
            )
            return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

        assert completions() != want
        assert post(None, {"model_path": new}).status_code == 401
        assert post(tenant, {"model_path": new}).status_code == 403
        r = post(operator, {"model_path": new + "-missing"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
        assert post(operator, {"model_path": 5}).status_code == 400
        long = {**stream_body(60), "max_tokens": 50}
        busy = threading.Thread(
            target=lambda: httpx.post(
                f"{url}/v1/completions", json=long, timeout=120, headers={"Authorization": f"Bearer {operator}"}
            ).read()
        )
        busy.start()
        try:
            refused = None
            for _ in range(100):
                refused = post(operator, {"model_path": new})
                if refused.status_code == 409:
                    break
            assert refused is not None and refused.status_code == 409, refused.text
            assert "in flight" in refused.json()["error"]["message"]
        finally:
            busy.join()
        r = post(operator, {"model_path": new})
        assert r.status_code == 200, r.text
        assert completions() == want
