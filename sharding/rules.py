"""Logical-axis rules as data: named presets mapping logical names to mesh axes.

A preset gives three tables: parameters, optimizer state (and, for zero2/fsdp, gradients), and
activations. Model code only names logical axes; nothing outside `sharding/` names a mesh axis.
Every preset also maps stacked layers to the pipeline axis and the sequence to the context axis;
on a mesh where those axes have size 1 that changes nothing.
"""

from __future__ import annotations

import dataclasses

from sharding.logical import Rules

DP = ("data", "fsdp")  # every data-parallel rank: the batch, and ZeRO's optimizer-state shards

_PP: Rules = {"layers": "pipeline", "stage": "pipeline"}  # stacked decoder layers and pipeline stages
_ACTIVATIONS: Rules = {"batch": DP, "length": "context", **_PP}
_EP: Rules = {"batch": ("data", "fsdp", "expert"), "experts": "expert"}
_SERVE_EP: Rules = {"experts": ("expert", "tensor")}
_TP: Rules = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    name: str
    params: Rules
    optimizer: Rules
    activations: Rules
    shard_grads: bool  # reduce-scatter gradients to the optimizer's layout (ZeRO-2 / FSDP)


PRESETS: dict[str, ShardingRules] = {
    "dp": ShardingRules("dp", _PP, _PP, _ACTIVATIONS, False),
    "zero1": ShardingRules("zero1", _PP, {**_PP, "embed": DP}, _ACTIVATIONS, False),
    "zero2": ShardingRules("zero2", _PP, {**_PP, "embed": DP}, _ACTIVATIONS, True),
    "fsdp": ShardingRules("fsdp", {**_PP, "embed": DP}, {**_PP, "embed": DP}, _ACTIVATIONS, True),
    "tp": ShardingRules("tp", {**_PP, **_TP}, {**_PP, **_TP}, {**_ACTIVATIONS, **_TP}, False),
    # expert parallelism: experts split over the expert axis, which also splits the batch (with data
    # and fsdp), so each device routes its own tokens to the experts' devices with an all-to-all
    "ep": ShardingRules(
        "ep", {**_PP, "experts": "expert"}, {**_PP, "experts": "expert"}, {**_ACTIVATIONS, **_EP}, False
    ),
    # serving with expert parallelism: tensor parallelism, but each expert whole on one device of
    # expert x tensor (not its MLP split over tensor); the replicated tokens are sliced over them
    "tp_ep": ShardingRules(
        "tp_ep",
        {**_PP, **_TP, **_SERVE_EP},
        {**_PP, **_TP, **_SERVE_EP},
        {**_ACTIVATIONS, **_TP, **_SERVE_EP},
        False,
    ),
    "fsdp_tp": ShardingRules(
        "fsdp_tp", {**_PP, **_TP, "embed": DP}, {**_PP, **_TP, "embed": DP}, {**_ACTIVATIONS, **_TP}, True
    ),
}


def get_rules(name: str) -> ShardingRules:
    if name not in PRESETS:
        raise ValueError(f"unknown sharding preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name]
