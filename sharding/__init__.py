"""Meshes and logical-axis rules (data, FSDP/ZeRO, tensor parallelism)."""

from sharding.logical import (
    LOGICAL_AXES,
    constrain,
    dim_shards,
    logical_rules,
    logical_to_spec,
    named_sharding,
    per_device,
    shard_state,
    sharded_axes,
)
from sharding.mesh import AXES, MeshConfig, initialize_distributed, make_mesh, parallel_sizes, tensor_parallel_mesh
from sharding.rules import PRESETS, ShardingRules, get_rules

__all__ = [
    "AXES",
    "LOGICAL_AXES",
    "PRESETS",
    "MeshConfig",
    "ShardingRules",
    "constrain",
    "dim_shards",
    "get_rules",
    "initialize_distributed",
    "logical_rules",
    "logical_to_spec",
    "make_mesh",
    "named_sharding",
    "parallel_sizes",
    "per_device",
    "shard_state",
    "sharded_axes",
    "tensor_parallel_mesh",
]
