"""vLLM drop-in parity of the HTTP server: the fields vLLM's OpenAI server accepts, with its
semantics, checked against `transformers` where numbers are involved."""

import json
import logging
import uuid

import httpx
import numpy as np
import pytest

import jaxinfra
from tests.hf_oracle import hf_logits, make_hf_model, save_hf_model
from tests.server_helpers import MODEL_NAME, running_server


@pytest.fixture(scope="module")
def hf_server(tmp_path_factory):
    """Our server on a random `transformers` checkpoint (byte-level tokenizer saved beside it)."""
    hf_model = make_hf_model("llama3_rope_scaling")
    path = save_hf_model(hf_model, tmp_path_factory.mktemp("hf"))
    jaxinfra.Tokenizer.byte_level().save(path)
    with running_server(model=str(path), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64) as (url, _):
        yield url, hf_model


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60, **kw)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_echo_logprobs_equal_transformers(hf_server):
    url, hf_model = hf_server
    prompt = np.random.default_rng(0).integers(3, 300, 17).tolist()
    expected = log_softmax(hf_logits(hf_model, np.array([prompt]))[0])
    for max_tokens in (0, 3):
        body = {"prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 1, "ignore_eos": True}
        r = post(url, "/v1/completions", body)  # ignore_eos: a sampled EOS would end the answer early
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + max_tokens and usage["completion_tokens"] == max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        got = np.array(lp["token_logprobs"][1 : len(prompt)])
        want = expected[np.arange(len(prompt) - 1), prompt[1:]]
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])  # top-1 plus the actual token
        assert lp["text_offset"] == sorted(lp["text_offset"])
        if max_tokens == 0:  # only the prompt comes back
            assert choice["text"] == jaxinfra.Tokenizer.byte_level().decode(prompt, skip_special_tokens=False)


def test_prompt_logprobs_and_token_ids_as_vllm_lays_them_out(hf_server):
    url, hf_model = hf_server
    prompt = [5, 17, 33, 101, 7]
    expected = log_softmax(hf_logits(hf_model, np.array([prompt]))[0])
    body = {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2, "return_token_ids": True, "temperature": 0}
    choice = post(url, "/v1/completions", body).json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt)
    for j in range(1, len(prompt)):
        entry = plp[j][str(prompt[j])]
        assert abs(entry["logprob"] - expected[j - 1, prompt[j]]) < 1e-4
        ranked = sorted(plp[j].values(), key=lambda e: -e["logprob"])
        assert ranked[0]["rank"] == 1 and "decoded_token" in ranked[0]
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 2
    chat = post(
        url,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "return_token_ids": True,
            "ignore_eos": True,
        },
    ).json()
    assert chat["prompt_token_ids"] and len(chat["choices"][0]["token_ids"]) == 2


def test_chat_top_logprobs_are_the_true_top_k_in_order(hf_server):
    url, _ = hf_server
    body = {
        "messages": [{"role": "user", "content": "abc"}],
        "max_tokens": 6,
        "temperature": 1.5,
        "seed": 4,
        "logprobs": True,
        "top_logprobs": 3,
    }
    for item in post(url, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]:
        tops = [t["logprob"] for t in item["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert item["logprob"] <= tops[0] + 1e-6  # the sampled token is never above the best


def test_streaming_usage_echo_and_best_of_one(hf_server):
    url, _ = hf_server
    body = {
        "prompt": "And God",
        "max_tokens": 5,
        "best_of": 1,
        "echo": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "temperature": 0,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"

    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    full = post(url, "/v1/completions", {**body, "stream": False, "stream_options": None}).json()
    assert text == full["choices"][0]["text"] and text.startswith("And God")
    assert all("usage" in c for c in chunks) and chunks[-1]["usage"]["completion_tokens"] == 5
    assert full["id"].startswith("cmpl-") and uuid.UUID(full["id"][5:])


def test_chat_kwargs_echo_and_special_tokens(hf_server):
    url, _ = hf_server
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Lo"}]
    base = {"messages": messages, "max_tokens": 3, "temperature": 0, "add_generation_prompt": False}
    plain = post(url, "/v1/chat/completions", base).json()
    echoed = post(url, "/v1/chat/completions", {**base, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "Lo" + plain["choices"][0]["message"]["content"]
    with_bos = post(url, "/v1/chat/completions", {**base, "add_special_tokens": True}).json()
    assert with_bos["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + 1
    r = post(url, "/v1/chat/completions", {**base, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    r = post(url, "/v1/chat/completions", {**base, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200


def test_every_vllm_field_is_accepted_and_unknown_ones_ignored(hf_server, caplog):
    url, _ = hf_server
    body = {
        "prompt": "In the beginning",
        "max_tokens": 4,
        "best_of": 1,
        "n": 1,
        "user": "u1",
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_tokens": 1,
        "ignore_eos": True,
        "stop_token_ids": [2],
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "add_special_tokens": True,
        "return_token_ids": True,
        "prompt_logprobs": 1,
        "cache_salt": "tenant-a",
        "priority": 0,
        "temperature": 3.0,
        "logprobs": 20,
        "seed": 1,
        "frobnicate": {"x": 1},
    }
    with caplog.at_level(logging.WARNING, logger="jaxinfra.serve"):
        r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert "frobnicate" in caplog.text
    assert r.json()["choices"][0]["logprobs"]["top_logprobs"][0]  # keyed by text: byte tokens may collide
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 20}
    content = post(url, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
    assert all(len(item["top_logprobs"]) == 20 for item in content)


def test_logit_bias_forces_and_forbids_tokens(hf_server):
    url, _ = hf_server
    body = {"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    free = post(url, "/v1/completions", body).json()["choices"][0]["token_ids"]
    forced = post(url, "/v1/completions", {**body, "logit_bias": {"42": 100}}).json()["choices"][0]["token_ids"]
    assert forced == [42] * 5
    banned = post(url, "/v1/completions", {**body, "logit_bias": {str(free[0]): -100}}).json()
    assert banned["choices"][0]["token_ids"][0] != free[0]
    for bad in ({"x": 1}, {"5": 101}, {"100000": 1}):
        r = post(url, "/v1/completions", {**body, "logit_bias": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_tokenizer_routes_version_models_and_error_objects(hf_server):
    url, _ = hf_server
    tok = post(url, "/tokenize", {"prompt": "And God", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 128
    assert post(url, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"].endswith("And God")
    chat_tok = post(url, "/tokenize", {"messages": [{"role": "user", "content": "x"}]}).json()
    assert chat_tok["count"] > 1
    assert httpx.get(f"{url}/version").json()["version"]
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["tokenizer_class"] and info["model_max_length"] == 128
    card = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert card["id"] == MODEL_NAME and card["max_model_len"] == 128 and card["permission"] and "root" in card
    for r in (
        httpx.get(f"{url}/v1/nope"),
        httpx.get(f"{url}/v1/completions"),
        httpx.post(f"{url}/v1/completions", content=b"\xff\xfe", headers={"content-type": "application/json"}),
        post(url, "/detokenize", {"tokens": [10**6]}),
        post(url, "/tokenize", {"prompt": "x", "messages": []}),
    ):
        assert 400 <= r.status_code < 500 and r.json()["error"]["message"], r.text


def test_priority_policy_orders_admission():
    """With the priority policy, a later but more urgent request is admitted first."""
    from serve import SamplingParams
    from tests.serve_helpers import engine

    eng = engine(scheduling_policy="priority", max_num_seqs=1)
    params = SamplingParams(max_tokens=2, temperature=0)
    eng.add_request("late-low", [1, 2, 3], params, priority=5)
    eng.add_request("urgent", [4, 5, 6], params, priority=-1)
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["urgent", "late-low"]
    with pytest.raises(ValueError, match="priority"):
        engine().add_request("x", [1, 2], params, priority=1)
