"""New weights for a running engine from a training state, a model or a params dict: checked
against the engine's own parameters (every name, every shape), cast to the engine's dtypes and placed
with the engine's shardings, so the compiled steps run them unchanged (no recompilation, no
checkpoint round trip)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfra.models.llama import unstack_layers

Params = dict[str, Any]


def _stacked(params: Params) -> bool:
    """Whether the decoder layers' weights are stacked [L, ...] (else one entry per layer index)."""
    layers = params.get("layers")
    return isinstance(layers, dict) and bool(layers) and not any(isinstance(k, int) for k in layers)


def _stack(params: Params, num_layers: int) -> Params:
    """Per-layer weights stacked [L, ...]: on the host for host arrays (one memcpy, no device op)."""

    def stack(*xs: Any) -> Any:
        return np.stack(xs) if all(isinstance(x, np.ndarray) for x in xs) else jnp.stack(xs)

    layers = params["layers"]
    return {**params, "layers": jax.tree.map(stack, *(layers[i] for i in range(num_layers)))}


def engine_layout(source: Any, engine: Params, num_layers: int) -> Params:
    """`source` (an nnx Module, an nnx.State, a TrainState's `.params`, or such a params dict, layers
    stacked or not) as a params dict in the engine's layout (stacked iff `engine` is)."""
    if isinstance(source, nnx.Module):
        source = nnx.state(source)
    if isinstance(source, nnx.State):
        source = nnx.to_pure_dict(source)
    params = getattr(source, "params", source)
    if not isinstance(params, dict):
        kind = type(source).__name__
        raise ValueError(f"update_weights takes a model, an nnx.State, a TrainState or a params dict, not {kind}")
    if _stacked(engine) and not _stacked(params):
        return _stack(params, num_layers)
    if _stacked(params) and not _stacked(engine):
        return unstack_layers(params, num_layers)
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
    values = []
    for path, current in old_leaves:
        value = new_leaves[path]
        if tuple(value.shape) != tuple(current.shape):
            name, shape = jax.tree_util.keystr(path), tuple(value.shape)
            raise ValueError(f"weight {name}: shape {shape}, the engine's is {tuple(current.shape)}")
        values.append(value if value.dtype == current.dtype else value.astype(current.dtype))
    placed = jax.device_put(values, [current.sharding for _, current in old_leaves])  # one batched transfer
    return jax.tree_util.tree_unflatten(treedef, placed)
