"""Meshes and logical-axis rules (data, FSDP, tensor parallelism)."""

from sharding.logical import LOGICAL_AXES, constrain, logical_rules, logical_to_spec, shard_state

__all__ = ["LOGICAL_AXES", "constrain", "logical_rules", "logical_to_spec", "shard_state"]
