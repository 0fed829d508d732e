"""The sizes a step pads to (bucket lists) and the KV pool's size in blocks for a memory budget."""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfra.config import ModelConfig
from pallas_kernels import addressable_blocks, kv_bytes_per_element, paged_head_dim, paged_impl
from serve.config import kv_storage_dtype


def buckets(limit: int, start: int, factor: int = 2) -> list[int]:
    """start, start * factor, ... capped at limit (which is always the last bucket)."""
    out = [min(start, limit)]
    while out[-1] < limit:
        out.append(min(out[-1] * factor, limit))
    return out


def fit(n: int, options: list[int]) -> int:
    """The smallest bucket that holds n."""
    for b in options:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {options[-1]}")


def num_blocks_for_memory(
    cfg: ModelConfig,
    block_size: int,
    kv_dtype: str,
    memory_bytes: int,
    attn_impl: str | None = None,
    tensor_parallel_size: int = 1,
) -> int:
    """KV blocks (every layer's K and V pools) whose 1/TP of the KV heads fit `memory_bytes` on each
    device, within what Triton addresses."""
    dtype = kv_storage_dtype(kv_dtype, cfg.dtype)
    d = paged_head_dim(cfg.head_dim, paged_impl(attn_impl))
    kv_heads = cfg.num_kv_heads // tensor_parallel_size
    per_block = 2 * cfg.num_layers * kv_heads * d * kv_bytes_per_element(dtype, d)
    num_blocks = int(max(memory_bytes, 0) // (per_block * block_size))
    block_elements = block_size * kv_heads * d
    # every layer's blocks form one pool (stacked on a layers axis): it must be addressable whole
    return addressable_blocks(num_blocks * cfg.num_layers, block_elements, jnp.dtype(dtype).itemsize) // cfg.num_layers
