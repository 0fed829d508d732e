"""How many KV blocks the engine gives each device: the one formula the engine and `jaxinfra
plan-serve` share, so that a plan's block count is the count the engine allocates.

On a GPU the engine may use `gpu_memory_utilization` of the device's memory (vLLM's meaning), never
more than what XLA's allocator hands out: the engine-core process sets XLA_PYTHON_CLIENT_MEM_FRACTION
to the utilization unless the environment already does (in a notebook XLA's default 0.75 caps it).
Out of that each device keeps its share of the weights, one step's activation peak, a margin for
XLA's own scratch (cuBLAS workspaces, autotuning buffers) and its 1/TP of the KV heads' blocks.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxinfra.config import ModelConfig
from jaxinfra.sizes import human_size
from serve.config import EngineArgs
from serve.core.runner.sizing import num_blocks_for_memory

DEFAULT_CPU_KV_MEMORY = 256 * 2**20  # per device, off GPU, when EngineArgs.kv_cache_memory is unset
DEFAULT_MAX_MODEL_LEN = 4096  # when neither EngineArgs.max_model_len nor a shorter model limit says less
XLA_MEM_FRACTION = 0.75  # XLA's GPU allocator default share of device memory
MEM_FRACTION_ENV = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
ALLOCATOR_ENV = ("XLA_CLIENT_ALLOCATOR", "XLA_PYTHON_CLIENT_ALLOCATOR")
XLA_SCRATCH_SHARE = 0.04  # of the engine's share of a device, left free for XLA's workspaces and autotuning


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
    """EngineArgs.max_model_len, or the model's context length capped at 4096."""
    return args.max_model_len or min(cfg.context_length, DEFAULT_MAX_MODEL_LEN)


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


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """One device as XLA's allocator sees it: `total` bytes, of which the allocator hands out at most
    `limit`; `in_use` is allocated now (after loading: the weights)."""

    total: int
    limit: int
    in_use: int = 0

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None, mem_fraction: float) -> DeviceMemory:
        """From `device.memory_stats()` under XLA's allocator, whose limit is `mem_fraction` of the
        device; statistics without a limit (the platform allocator) are a ValueError asking for
        kv_cache_memory, since the device's size is then unknown."""
        if not stats or "bytes_limit" not in stats:
            allocator = next((os.environ[k] for k in ALLOCATOR_ENV if os.environ.get(k)), "default")
            raise ValueError(
                f"the device reports no memory limit (XLA allocator {allocator!r}), so the KV pool cannot "
                "be sized from it: set EngineArgs.kv_cache_memory (--kv-cache-memory), e.g. 20GiB"
            )
        limit = int(stats["bytes_limit"])
        return cls(total=int(limit / mem_fraction), limit=limit, in_use=int(stats.get("bytes_in_use", 0)))


def kv_pool_bytes(memory: DeviceMemory, utilization: float, weights: int, activations: int) -> int:
    """Bytes of one device left for KV blocks: `utilization` of the device within the allocator's
    limit, less this device's `weights`, one step's `activations` peak and XLA's scratch margin
    (XLA_SCRATCH_SHARE of it). A model that does not fit is a ValueError naming all four."""
    ceiling = min(memory.limit, int(memory.total * utilization))
    margin = int(ceiling * XLA_SCRATCH_SHARE)
    left = ceiling - weights - activations - margin
    if left <= 0:
        raise ValueError(
            f"the model does not fit on the device: {human_size(weights)} of weights, a step's activation "
            f"peak of {human_size(activations)} and {human_size(margin)} kept for XLA's workspaces leave nothing "
            f"of the {human_size(ceiling)} available (gpu_memory_utilization {utilization:g} of "
            f"{human_size(memory.total)}, XLA's allocator limit {human_size(memory.limit)}); quantize the weights, "
            "raise tensor_parallel_size, or lower max_num_batched_tokens or max_num_seqs"
        )
    return left


def kv_cache_blocks(
    cfg: ModelConfig,
    args: EngineArgs,
    step_tokens: int,
    device: DeviceMemory | None = None,
    weight_bytes: int = 0,
    draft: ModelConfig | None = None,
) -> int:
    """Blocks of the KV pool (each device holds its 1/TP of every block's heads):
    `args.kv_cache_memory` bytes per device (256 MiB off GPU by default), else what `device` leaves
    (kv_pool_bytes) after the weights' share (`weight_bytes` in all) and one step's activations. A
    `draft` model's pool (as many blocks) comes out of the same bytes."""
    tp = args.tensor_parallel_size
    if args.kv_cache_memory is not None or device is None:
        memory = args.kv_cache_memory or DEFAULT_CPU_KV_MEMORY
    else:
        activations = step_workspace_bytes(cfg, step_tokens, args.max_num_seqs, tp)
        memory = kv_pool_bytes(device, args.gpu_memory_utilization, weight_bytes // tp, activations)
    return num_blocks_for_memory(cfg, args.block_size, args.kv_cache_dtype, memory, tp, draft)
