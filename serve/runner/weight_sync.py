"""New weights for a running engine from a training state, a model or a params dict: checked
against the engine's own parameters (every name, every shape), cast to the engine's dtypes and placed
with the engine's shardings, so the compiled steps run them unchanged (no recompilation, no
checkpoint round trip)."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jaxinfra.models.llama import unstack_layers

Params = dict[str, Any]


def pure_params(source: Any, num_layers: int) -> Params:
    """The per-layer params dict of `source`: an nnx Module, an nnx.State, a TrainState (its
    `.params`, layers stacked or not) or such a dict."""
    if isinstance(source, nnx.Module):
        source = nnx.state(source)
    if isinstance(source, nnx.State):
        source = nnx.to_pure_dict(source)
    params = getattr(source, "params", source)
    if not isinstance(params, dict):
        kind = type(source).__name__
        raise ValueError(f"update_weights takes a model, an nnx.State, a TrainState or a params dict, not {kind}")
    layers = params.get("layers")
    if isinstance(layers, dict) and layers and not any(isinstance(k, int) for k in layers):
        params = unstack_layers(params, num_layers)  # the trainer's scanned layout: [L, ...] per leaf
    return params


def place_like(new: Params, old: Params) -> Params:
    """`new`'s arrays in `old`'s dtypes and shardings; a name, or a shape, that differs is a
    ValueError naming it."""
    new_leaves = dict(jax.tree_util.tree_flatten_with_path(new)[0])
    old_leaves, treedef = jax.tree_util.tree_flatten_with_path(old)
    missing = [jax.tree_util.keystr(p) for p, _ in old_leaves if p not in new_leaves]
    extra = sorted(set(map(jax.tree_util.keystr, new_leaves)) - {jax.tree_util.keystr(p) for p, _ in old_leaves})
    if missing or extra:
        raise ValueError(
            f"the new weights do not match the engine's parameters: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    placed = []
    for path, current in old_leaves:
        value = new_leaves[path]
        if tuple(value.shape) != tuple(current.shape):
            name, shape = jax.tree_util.keystr(path), tuple(value.shape)
            raise ValueError(f"weight {name}: shape {shape}, the engine's is {tuple(current.shape)}")
        placed.append(jax.device_put(value.astype(current.dtype), current.sharding))
    return jax.tree_util.tree_unflatten(treedef, placed)
