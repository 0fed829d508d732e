"""Random KV pools for the transfer tests: bf16, and int8 with float32 scales (the engine's layouts)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels import PagedKVCache

SHAPE = (2, 8, 4, 4, 8)  # layers, blocks, block_size, kv_heads, head_dim


def random_pool(kind: str, seed: int, shape: tuple[int, ...] = SHAPE) -> PagedKVCache:
    """A pool of `kind` ("bf16" or "int8") with every element random (scales too)."""
    rng = np.random.default_rng(seed)
    if kind == "bf16":
        return PagedKVCache(*(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2)))
    kv = (jnp.asarray(rng.integers(-128, 128, shape), jnp.int8) for _ in range(2))
    scales = (jnp.asarray(rng.random(shape[:-1]), jnp.float32) for _ in range(2))
    return PagedKVCache(*kv, *scales)


def blocks_of(pool: PagedKVCache, ids: list[int]) -> dict[str, np.ndarray]:
    """The host bytes of blocks `ids` of every array (as unsigned ints: compared bitwise)."""
    out = {}
    for name in ("k", "v", "k_scale", "v_scale"):
        a = getattr(pool, name)
        if a is not None:
            host = np.asarray(a)[:, ids]
            out[name] = host.view(f"u{host.dtype.itemsize}")
    return out
