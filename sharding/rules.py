"""Logical-axis rules as data: named presets mapping logical names to mesh axes.

A preset gives three tables: parameters, optimizer state (and, for zero2/fsdp, gradients), and
activations. Model code only names logical axes; nothing outside `sharding/` names a mesh axis.
"""

from __future__ import annotations

import dataclasses

from sharding.logical import Rules

DP = ("data", "fsdp")  # every data-parallel rank: the batch, and ZeRO's optimizer-state shards

_ACTIVATIONS = {"batch": DP}
_TP = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    name: str
    params: Rules
    optimizer: Rules
    activations: Rules
    shard_grads: bool  # reduce-scatter gradients to the optimizer's layout (ZeRO-2 / FSDP)


PRESETS: dict[str, ShardingRules] = {
    "dp": ShardingRules("dp", {}, {}, _ACTIVATIONS, False),
    "zero1": ShardingRules("zero1", {}, {"embed": DP}, _ACTIVATIONS, False),
    "zero2": ShardingRules("zero2", {}, {"embed": DP}, _ACTIVATIONS, True),
    "fsdp": ShardingRules("fsdp", {"embed": DP}, {"embed": DP}, _ACTIVATIONS, True),
    "tp": ShardingRules("tp", _TP, _TP, {**_ACTIVATIONS, **_TP}, False),
    "fsdp_tp": ShardingRules("fsdp_tp", {**_TP, "embed": DP}, {**_TP, "embed": DP}, {**_ACTIVATIONS, **_TP}, True),
}


def get_rules(name: str) -> ShardingRules:
    if name not in PRESETS:
        raise ValueError(f"unknown sharding preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name]
