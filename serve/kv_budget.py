"""How many KV blocks the engine gives each device: the one formula the engine and `jaxinfra
plan-serve` share, so that a plan's block count is the count the engine allocates.

On a GPU the engine may use `gpu_memory_utilization` of the device's memory (vLLM's meaning), capped
by XLA's allocator limit: the engine-core process sets XLA_PYTHON_CLIENT_MEM_FRACTION to the
utilization unless the environment already does (in a notebook XLA's default 0.75 caps it). Each
device keeps its share of the weights, one step's activations and its 1/TP of the KV heads.
"""

from __future__ import annotations

import os

from jaxinfra.config import ModelConfig
from serve.config import EngineArgs
from serve.runner.sizing import num_blocks_for_memory

DEFAULT_CPU_KV_MEMORY = 256 * 2**20  # per device, off GPU, when EngineArgs.kv_cache_memory is unset
DEFAULT_MAX_MODEL_LEN = 4096  # when neither EngineArgs.max_model_len nor a shorter model limit says less
XLA_MEM_FRACTION = 0.75  # XLA's GPU allocator default share of device memory
MEM_FRACTION_ENV = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def xla_mem_fraction(default: float = XLA_MEM_FRACTION) -> float:
    """The share of GPU memory XLA's allocator takes: its environment variables, else `default`."""
    text = next((os.environ[k] for k in MEM_FRACTION_ENV if os.environ.get(k)), None)
    return float(text) if text else default


def core_process_env(args: EngineArgs) -> dict[str, str]:
    """Environment for an engine-core process: XLA's allocator takes the utilization's share of
    the GPU unless the user has set the fraction."""
    if any(os.environ.get(k) for k in MEM_FRACTION_ENV):
        return {}
    return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{args.gpu_memory_utilization:g}"}


def engine_max_model_len(cfg: ModelConfig, args: EngineArgs) -> int:
    """EngineArgs.max_model_len, or the model's max_position_embeddings capped at 4096."""
    return args.max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


def step_token_budget(args: EngineArgs, max_model_len: int) -> int:
    """Tokens one step may schedule (max_num_batched_tokens, or its default); one the engine cannot
    run is a ValueError naming the field."""
    budget = args.max_num_batched_tokens or (2048 if args.enable_chunked_prefill else max_model_len)
    if budget < args.max_num_seqs and args.max_num_batched_tokens is not None:
        raise ValueError(f"EngineArgs.max_num_batched_tokens ({budget}) must be >= max_num_seqs ({args.max_num_seqs})")
    if budget < max_model_len and not args.enable_chunked_prefill:
        raise ValueError(
            f"EngineArgs.max_num_batched_tokens ({budget}) must be >= max_model_len "
            f"({max_model_len}) when chunked prefill is off"
        )
    return max(budget, args.max_num_seqs)


def step_workspace_bytes(cfg: ModelConfig, tokens: int, seqs: int, tensor_parallel_size: int = 1) -> int:
    """Estimated activations of one serving step of `tokens` tokens on one device (forward only: one
    layer's intermediates live at a time): residual and its norm, Q/K/V, the attention output and
    the SwiGLU gate/up/product per token, plus float32 logits and probabilities at `seqs` rows."""
    import jax.numpy as jnp

    a = jnp.dtype(cfg.dtype).itemsize
    heads = (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_token = 2 * cfg.hidden_size + (heads + 3 * cfg.intermediate_size) // tensor_parallel_size
    return tokens * per_token * a + 2 * seqs * cfg.vocab_size * 4


def usable_bytes(bytes_limit: int, utilization: float, mem_fraction: float) -> int:
    """Bytes of one device the engine may use: `utilization` of the device's memory (the allocator's
    limit is `mem_fraction` of it), never more than the allocator's limit."""
    return min(bytes_limit, int(bytes_limit / mem_fraction * utilization))


def kv_cache_blocks(
    cfg: ModelConfig,
    args: EngineArgs,
    step_tokens: int,
    usable: int | None = None,
    weight_bytes: int = 0,
    draft: ModelConfig | None = None,
) -> int:
    """Blocks of the KV pool (each device holds its 1/TP of every block's heads):
    `args.kv_cache_memory` bytes per device (256 MiB off GPU by default), else `usable` bytes per
    device less the weights' share (`weight_bytes` in all) and one step's workspace. A `draft`
    model's pool (as many blocks) comes out of the same bytes."""
    tp = args.tensor_parallel_size
    if args.kv_cache_memory is not None or usable is None:
        memory = args.kv_cache_memory or DEFAULT_CPU_KV_MEMORY
    else:
        memory = usable - weight_bytes // tp - step_workspace_bytes(cfg, step_tokens, args.max_num_seqs, tp)
    return num_blocks_for_memory(cfg, args.block_size, args.kv_cache_dtype, memory, args.attn_impl, tp, draft)
