"""plan-serve: planned KV blocks equal what the engine allocates; Llama-3.1-8B on an H200 by hand."""

import dataclasses
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxinfra.cli import main as cli_main
from jaxinfra.config import ModelConfig
from jaxinfra.loading import DEFAULT_EAGLE_NAME, DEFAULT_MODEL, load_config, load_model, model_dir
from jaxinfra.models import LlamaModel
from jaxinfra.models.eagle import load_eagle_head
from jaxinfra.workload import Workload
from pallas_kernels import PagedKVCache
from serve.config import EngineArgs
from serve.core.engine_core import EngineCore
from serve.core.kv_budget import step_token_budget, step_workspace_bytes
from serve.plan_serve import GPUS, Device, eagle_head_bytes, plan, weight_bytes

README = Path(__file__).resolve().parents[1] / "README.md"
TINY = ModelConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)
WORKLOAD = Workload.from_percentiles((100, 400), (50, 200))


def allocated_pool_bytes(core: EngineCore) -> int:
    caches = jax.tree.leaves(vars(core.runner), is_leaf=lambda x: isinstance(x, PagedKVCache))
    return sum(leaf.nbytes for c in caches if isinstance(c, PagedKVCache) for leaf in jax.tree.leaves(c))


@pytest.mark.parametrize(
    "kv_dtype,block_size,memory", [("auto", 16, 3_000_000), ("int8", 32, 1_234_567), ("fp8", 16, 777_777)]
)
def test_planned_blocks_equal_allocated(kv_dtype: str, block_size: int, memory: int) -> None:
    args = EngineArgs(
        model="tiny",
        block_size=block_size,
        kv_cache_dtype=kv_dtype,
        kv_cache_memory=memory,
        max_model_len=128,
        max_num_seqs=4,
    )
    core = EngineCore(LlamaModel(TINY, nnx.Rngs(0)), args)
    planned = plan("tiny", TINY, args, Device("cpu", None), WORKLOAD)
    assert planned.num_blocks == core.block_manager.num_blocks > 0
    assert planned.kv_pool_bytes_per_device == allocated_pool_bytes(core) <= memory
    assert planned.kv_tokens == planned.num_blocks * block_size


LLAMA_8B_PARAMS = (
    2 * 128256 * 4096  # embeddings and LM head (untied)
    + 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096)  # q, o, k, v, MLP, two norms
    + 4096  # final norm
)


def hand_plan(kv_dtype: str, tp: int) -> dict[str, int]:
    """Llama-3.1-8B (bf16) on an H200 with the engine's defaults, computed by hand."""
    usable = int(143771 * 2**20 * 0.9)  # gpu_memory_utilization of the device (the core sets XLA's fraction to it)
    weights = 2 * LLAMA_8B_PARAMS
    per_token = 2 * 32 * 8 * 128 * (2 if kv_dtype == "auto" else 1) + (2 * 32 * 8 * 4 if kv_dtype == "int8" else 0)
    # one step of 2048 tokens: residual + norm, q/k/v/o and gate/up/product (split over TP), f32 logits and probs
    workspace = 2048 * (2 * 4096 + (80 * 128 + 3 * 14336) // tp) * 2 + 2 * 256 * 128256 * 4
    scratch = int(usable * 0.04)  # left free for XLA's workspaces and autotuning
    blocks = (usable - weights // tp - workspace - scratch) // (per_token // tp * 16)  # each device: 1/TP of the heads
    return {
        "weight_bytes_per_device": weights // tp,
        "kv_bytes_per_token": per_token,
        "num_blocks": blocks,
        "kv_tokens": blocks * 16,
        "kv_pool_bytes_per_device": blocks * 16 * per_token // tp,
        "concurrency_p50": blocks // math.ceil((512 + 256) / 16),
        "concurrency_p99": blocks // math.ceil((2048 + 1024) / 16),
        "long_sequences": blocks // (131_072 // 16),  # whole 128K-token sequences
    }


@pytest.mark.parametrize("kv_dtype,tp", [("auto", 1), ("int8", 1), ("auto", 2), ("int8", 2)])
def test_llama_8b_on_h200_matches_hand_computed_bytes_and_readme(kv_dtype: str, tp: int) -> None:
    cfg = load_config("llama-3.1-8b")
    assert weight_bytes(cfg) == 2 * LLAMA_8B_PARAMS == 2 * cfg.num_params
    args = EngineArgs(model="llama-3.1-8b", kv_cache_dtype=kv_dtype, tensor_parallel_size=tp, attn_impl="pallas")
    workload = Workload.from_percentiles((512, 2048), (256, 1024))
    got = plan("llama-3.1-8b", cfg, args, Device("H200", GPUS["h200"]), workload).to_dict()
    want = hand_plan(kv_dtype, tp)
    assert {k: got[k] for k in want} == want
    row = f"| {'bf16' if kv_dtype == 'auto' else 'int8'} | {tp} |"
    line = next(x for x in README.read_text().splitlines() if x.startswith(row))
    numbers = [int(n.replace(",", "")) for n in re.findall(r"\b\d[\d,]*\b", line.split("|", 3)[3])]
    assert numbers == [
        want["weight_bytes_per_device"],
        want["kv_bytes_per_token"],
        want["num_blocks"],
        want["kv_tokens"],
        want["concurrency_p50"],
        want["concurrency_p99"],
    ]


def test_workload_from_jsonl_and_recommended_max_model_len(tmp_path: Path) -> None:
    lines = [{"prompt_tokens": p, "completion_tokens": 10} for p in range(1, 101)]
    lines[-1] = {"usage": {"prompt_tokens": 990, "completion_tokens": 10}}  # logged OpenAI responses nest it
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    w = Workload.from_jsonl(path)
    assert (w.prompt_p50, w.prompt_p99, w.output_p50, w.output_p99, w.longest) == (50, 99, 10, 10, 1000)
    args = EngineArgs(model="tiny", kv_cache_memory=10**8, max_num_seqs=4)
    p = plan("tiny", TINY.replace(max_position_embeddings=100_000), args, Device("cpu", None), w)
    assert p.recommended_max_model_len == 1200
    small = plan("tiny", TINY.replace(max_position_embeddings=1024), args, Device("cpu", None), w)
    assert small.recommended_max_model_len == small.max_model_len_limit == 1024
    assert any("exceeds what fits" in n for n in small.notes)
    path.write_text('{"prompt_tokens": "many"}\n')
    with pytest.raises(ValueError, match="requests.jsonl:1"):
        Workload.from_jsonl(path)


def test_cli_json_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan-serve", "--model", "tiny-llama", "--gpu", "L4", "--json", "--prompt-len", "64,128"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["plan"]["device_bytes"] == GPUS["l4"] and body["plan"]["num_blocks"] > 0
    kinds = {(v["kv_cache_dtype"], v["quantization"]) for v in body["variants"] if isinstance(v, dict)}
    assert ("int8", None) in kinds and ("fp8", "int8") in kinds
    assert cli_main(["plan-serve", "--model", "tiny-llama", "--gpu", "Z9"]) == 2
    assert "unknown --gpu 'Z9'" in capsys.readouterr().err
    assert cli_main(["plan-serve", "--model", "llama-3.1-8b", "--gpu", "L4", "--gpu-memory-utilization", "0.5"]) == 2
    assert "does not fit" in capsys.readouterr().err


def test_quantized_checkpoint_plans_its_stored_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {**TINY.to_hf(), "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(bytes(54321))
    argv = ["plan-serve", "--model", str(tmp_path), "--kv-cache-memory", "1MB", "--json"]
    assert cli_main(argv) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["plan"]["weight_bytes_total"] == 54321
    assert {(v["kv_cache_dtype"], v["quantization"]) for v in body["variants"]} == {("int8", None), ("fp8", None)}
    assert cli_main([*argv, "--quantization", "int4"]) == 2
    assert "already quantized" in capsys.readouterr().err


def test_workspace_estimate_near_xla_memory_analysis() -> None:
    """The step estimate against what XLA allocates for a forward of `tokens` tokens (temporaries and
    the float32 logits, here at every token), where attention scores are a small part of it."""
    tokens = 256
    cfg = TINY.replace(vocab_size=4096, hidden_size=256, intermediate_size=1024, head_dim=64, dtype="bfloat16")
    graph, state = nnx.split(LlamaModel(cfg, nnx.Rngs(0)))
    ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    stats = jax.jit(lambda s, x: nnx.merge(graph, s)(x)).lower(state, ids).compile().memory_analysis()
    compiled = stats.temp_size_in_bytes + stats.output_size_in_bytes
    assert 0.75 < step_workspace_bytes(cfg, tokens, seqs=tokens) / compiled < 1.25


def test_moe_model_plans_dense_weights_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan-serve", "--model", "tiny-mixtral", "--kv-cache-memory", "8MB", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["plan"]["weight_bytes_total"] == weight_bytes(load_config("tiny-mixtral")) > 0
    refused = [v for v in body["variants"] if isinstance(v, str)]
    assert len(refused) == 6 and all("experts" in v for v in refused)  # int8/int4 weights x three KV dtypes


def test_a_step_budget_the_engine_cannot_run_is_refused_for_engine_and_plan_alike() -> None:
    few = EngineArgs(model="tiny", max_num_batched_tokens=4, max_num_seqs=8)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"):
        step_token_budget(few, 128)
    unchunked = EngineArgs(model="tiny", max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="when chunked prefill is off"):
        plan("tiny", TINY, unchunked, Device("cpu", None), WORKLOAD)
    assert step_token_budget(EngineArgs(model="tiny", max_num_seqs=8), 128) == 2048


def test_a_draft_models_pool_shares_the_kv_budget_in_engine_and_plan() -> None:
    """Speculative decoding with a draft model: its KV pool (as many blocks as the target's) comes out
    of the same kv_cache_memory, in the engine and in plan-serve alike."""
    spec = {"method": "draft_model", "model": "default-draft", "num_speculative_tokens": 2}
    args = EngineArgs(model=str(DEFAULT_MODEL), kv_cache_memory=5_000_000, max_model_len=256, max_num_seqs=4)
    cfg = load_config(DEFAULT_MODEL)
    alone = plan("default", cfg, args, Device("cpu", None), WORKLOAD)
    args = dataclasses.replace(args, speculative_config=spec)
    core = EngineCore(load_model(DEFAULT_MODEL), args)
    planned = plan("default", cfg, args, Device("cpu", None), WORKLOAD)
    assert core.runner.proposer is not None
    pools = [core.runner.kv_cache, core.runner.proposer.kv_cache]
    allocated = sum(leaf.nbytes for pool in pools for leaf in jax.tree.leaves(pool))
    assert planned.num_blocks == core.block_manager.num_blocks < alone.num_blocks
    assert planned.kv_pool_bytes_per_device == allocated <= 5_000_000


def test_an_eagle_heads_weights_are_planned_without_the_embedding_it_shares() -> None:
    """plan-serve counts what the engine holds for a head: its fc, layer and norm (the embedding and LM
    head are the target's), so a GPU plan with EAGLE leaves the blocks those bytes leave."""
    cfg = load_config(DEFAULT_MODEL)
    head = load_eagle_head(model_dir(DEFAULT_EAGLE_NAME), cfg)
    held = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(head)))
    head_cfg = load_config(model_dir(DEFAULT_EAGLE_NAME))
    assert eagle_head_bytes(head_cfg) == held < weight_bytes(head_cfg)
    spec = {"method": "eagle", "model": DEFAULT_EAGLE_NAME, "num_speculative_tokens": 3}
    args = EngineArgs(model=str(DEFAULT_MODEL), max_model_len=256, max_num_seqs=4)
    gpu = Device("small", total=64_000_000, mem_fraction=0.9)
    alone = plan("default", cfg, args, gpu, WORKLOAD)
    eagle = plan("default", cfg, dataclasses.replace(args, speculative_config=spec), gpu, WORKLOAD)
    assert eagle.weight_bytes_per_device == alone.weight_bytes_per_device + held
