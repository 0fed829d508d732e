"""KV blocks between two meshes of one JAX process (a prefill mesh and a decode mesh).

The blocks are gathered by a jitted take on the prefill devices, moved with `jax.device_put` to the
decode pool's sharding (KV heads split over each mesh's tensor axis, so the layouts may differ) and
scattered by a jitted update of the decode pool, donated so it is written in place.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from pallas_kernels import PagedKVCache
from serve.kv_transfer.blocks import gather_blocks, scatter_blocks
from sharding import MeshConfig, get_rules, make_mesh, named_sharding

POOL_AXES = (None, None, None, "kv_heads", "head_dim")  # [layers, blocks, block_size, kv_heads, head_dim]


def carve_meshes(num_prefill: int, num_decode: int) -> tuple[Mesh, Mesh]:
    """A tensor-parallel prefill mesh on the first `num_prefill` devices, a decode mesh on the next."""
    devices = jax.devices()
    if num_prefill < 1 or num_decode < 1 or num_prefill + num_decode > len(devices):
        raise ValueError(f"num_prefill ({num_prefill}) + num_decode ({num_decode}) must fit {len(devices)} devices")
    prefill = make_mesh(MeshConfig(data=1, fsdp=1, tensor=num_prefill), devices[:num_prefill])
    decode = make_mesh(MeshConfig(data=1, fsdp=1, tensor=num_decode), devices[num_prefill : num_prefill + num_decode])
    return prefill, decode


def pool_sharding(pool: PagedKVCache, mesh: Mesh) -> PagedKVCache:
    """Each pool array's sharding on `mesh` (the serving runner's: KV heads over the tensor axis)."""
    rules = get_rules("tp").params
    return jax.tree.map(lambda a: named_sharding(POOL_AXES[: a.ndim], rules, a.shape, mesh), pool)


def place_pool(pool: PagedKVCache, mesh: Mesh) -> PagedKVCache:
    """`pool` laid out on `mesh`."""
    return jax.device_put(pool, pool_sharding(pool, mesh))


def transfer_blocks(src: PagedKVCache, src_ids: list[int], dst: PagedKVCache, dst_ids: list[int]) -> PagedKVCache:
    """`dst` (donated) with `src`'s blocks `src_ids` written at `dst_ids`, bitwise."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"src_ids ({len(src_ids)}) and dst_ids ({len(dst_ids)}) must be as many")
    src_mesh, dst_mesh = _mesh(src), _mesh(dst)
    blocks = gather_blocks(src, _replicated(src_ids, src_mesh))
    moved = jax.device_put(blocks, pool_sharding(blocks, dst_mesh))
    return scatter_blocks(dst, _replicated(dst_ids, dst_mesh), moved)


def _mesh(pool: PagedKVCache) -> Mesh:
    """The mesh a pool was placed on."""
    sharding = pool.k.sharding
    if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh):
        raise ValueError("transfer_blocks needs pools placed on meshes (place_pool)")
    return sharding.mesh


def _replicated(ids: list[int], mesh: Mesh) -> jax.Array:
    """Block ids on every device of `mesh`."""
    return jax.device_put(np.asarray(ids, np.int32), NamedSharding(mesh, jax.P()))
