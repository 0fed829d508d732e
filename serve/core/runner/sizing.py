"""The sizes a step pads to (bucket lists) and the KV pool's size in blocks for a memory budget."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp

from jaxinfra.config import ModelConfig
from pallas_kernels import addressable_blocks, kv_bytes_per_element
from serve.config import kv_storage_dtype


def buckets(limit: int, start: int, factor: int = 2) -> list[int]:
    """start, start * factor, ... capped at limit (which is always the last bucket)."""
    out = [min(start, limit)]
    while out[-1] < limit:
        out.append(min(out[-1] * factor, limit))
    return out


def fit(n: int, options: Sequence[int]) -> int:
    """The smallest bucket that holds n."""
    for b in options:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {options[-1]}")


def kv_block_bytes(cfg: ModelConfig, block_size: int, kv_dtype: str, tensor_parallel_size: int = 1) -> int:
    """Bytes of one KV block on each device: every layer's K and V for its 1/TP of the KV heads, at
    the true head dim (the kernels pad 80 or 96 to a power of two in registers only)."""
    dtype, d = kv_storage_dtype(kv_dtype, cfg.dtype), cfg.head_dim
    kv_heads = cfg.num_kv_heads // tensor_parallel_size
    return math.ceil(2 * cfg.num_layers * kv_heads * d * kv_bytes_per_element(dtype, d) * block_size)


def num_blocks_for_memory(
    cfg: ModelConfig,
    block_size: int,
    kv_dtype: str,
    memory_bytes: int,
    tensor_parallel_size: int = 1,
    draft: ModelConfig | None = None,
) -> int:
    """KV blocks whose 1/TP of the KV heads fit `memory_bytes` on each device, within what Triton
    addresses; with a `draft` model (speculative decoding's), its pool of as many blocks shares them."""
    models = (cfg,) if draft is None else (cfg, draft)
    per_block = sum(kv_block_bytes(m, block_size, kv_dtype, tensor_parallel_size) for m in models)
    num_blocks = int(max(memory_bytes, 0) // per_block)
    limits = []
    for m in models:  # every layer's blocks form one pool (stacked on a layers axis): addressable whole
        block_elements = block_size * (m.num_kv_heads // tensor_parallel_size) * m.head_dim
        itemsize = jnp.dtype(kv_storage_dtype(kv_dtype, m.dtype)).itemsize
        limits.append(addressable_blocks(num_blocks * m.num_layers, block_elements, itemsize) // m.num_layers)
    return min(limits)
