"""Context-parallel prefill in serving (`context_parallel_size`): a step's flat token batch split over
devices, each attending its slice of queries to every new key plus the cached pages."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfra.config import ModelConfig
from jaxinfra.loading import load_config
from pallas_kernels import PagedKVCache, PagedMetadata, attend
from serve import EngineArgs
from serve.core.layout import resolve
from serve.http.main import main
from tests.check_scripts import run_check

BS, KH, H, D = 4, 2, 4, 8


def flat_batch() -> tuple[PagedMetadata, int]:
    """A decode (8 cached keys), a prompt chunk after 4 cached keys, a new prompt and 4 padding tokens:
    the metadata and the number of tokens (20)."""
    q_lens, kv_lens = np.array([1, 10, 5]), np.array([9, 14, 5])
    tables = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    slots = [tables[s, p // BS] * BS + p % BS for s in range(3) for p in range(kv_lens[s] - q_lens[s], kv_lens[s])] + [
        -1
    ] * 4
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    meta = PagedMetadata(*(jnp.asarray(x, jnp.int32) for x in (slots, tables, cu, kv_lens)), max_q_len=10)
    return meta, len(slots)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_query_slices_attend_as_the_whole_batch(impl: str) -> None:
    """Each of 4 slices of the flat batch's queries, with every new key written (`query_slice`), gives
    the whole batch's outputs for its tokens and the same pools: the causal mask stays absolute."""
    meta, n = flat_batch()
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (1, n, H, D))
    k, v = (jax.random.normal(key, (1, n, KH, D)) for key in keys[1:3])
    pool = PagedKVCache(*(jax.random.normal(key, (12, BS, KH, D)) for key in keys[3:]))  # the cached keys
    whole, written = attend(q, k, v, meta, pool, impl=impl)
    part = n // 4
    for i in range(4):
        out, cache = attend(q[:, i * part : (i + 1) * part], k, v, meta.query_slice(i * part, part), pool, impl=impl)
        np.testing.assert_allclose(out, whole[:, i * part : (i + 1) * part], rtol=1e-5, atol=1e-6, err_msg=str(i))
        np.testing.assert_array_equal(cache.k, written.k)
        np.testing.assert_array_equal(cache.v, written.v)
    assert np.abs(np.asarray(whole[0, :16])).max(axis=(1, 2)).min() > 0.1  # every real token has an output


@pytest.mark.slow
def test_context_parallel_prefill_equals_one_device() -> None:
    """On 8 virtual CPU devices: greedy tokens of `LLM` with context_parallel_size 4 and 8 (and 2 tensor
    x 4 context, and with the XLA paged attention) equal one device's, for prompts of up to 4 prefill
    chunks and a prompt with 64 cached tokens; each device's compiled layer holds a quarter (an eighth)
    of a 32-token chunk and K/V are all-gathered; the KV pools are replicated over the context axis."""
    out = run_check("tests.sharding.cp_serving_check", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("CPREPORT"))[len("CPREPORT") :])
    one = report.pop("one")
    assert one["cached"] == 64 and all(len(t) == 10 for t in one["tokens"])
    for name, run in report.items():
        assert run["tokens"] == one["tokens"], name
        assert run["cached"] == 64, name
        assert run["activation_slice"], name
        assert run["kv_gathers"] >= 2, name  # K and V
    for name, parts in (("cp4", 4), ("cp8", 8)):
        assert report[name]["pool_devices"] == parts and report[name]["pool_replicated"], name
    assert report["tp2_cp4"]["pool_devices"] == 8 and not report["tp2_cp4"]["pool_replicated"]  # heads split


@pytest.mark.parametrize(
    "args,message",
    [
        (dict(context_parallel_size=0), "EngineArgs.context_parallel_size must be a positive int, got 0"),
        (dict(context_parallel_size=2, enable_lora=True), "context_parallel_size must be 1 with enable_lora"),
        (
            dict(context_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
            "context_parallel_size must be 1 with speculative_config",
        ),
        (
            dict(context_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),
            "context_parallel_size must be 1 with expert parallelism",
        ),
    ],
)
def test_unsupported_combinations_are_refused(args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**args)


def test_layout_refuses_a_moe_model_and_a_size_that_does_not_divide_the_devices() -> None:
    devices = len(jax.devices())
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    args = EngineArgs(max_model_len=64, num_gpu_blocks_override=16, context_parallel_size=devices + 1)
    with pytest.raises(ValueError, match=rf"context_parallel_size \({devices + 1}\) x tensor_parallel_size \(1\) "):
        resolve(args, cfg)
    args = EngineArgs(max_model_len=64, num_gpu_blocks_override=16, context_parallel_size=2)
    with pytest.raises(ValueError, match="context_parallel_size \\(2\\) needs a dense model"):
        resolve(args, load_config("tiny-mixtral"))
    assert resolve(EngineArgs(max_model_len=64, num_gpu_blocks_override=16), cfg).context_parallel_size == 1


def test_the_flag_is_checked_before_an_engine_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--no-warmup", "--context-parallel-size", "0"]) == 2
    assert "argument --context-parallel-size must be a positive int" in capsys.readouterr().err
