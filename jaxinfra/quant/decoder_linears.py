"""Where a decoder layer's linears are and how a quantizer reads and rewrites them: their names, grouped
by the activations they read; get and put; their shapes, logical axes and float32 matrices; scales
folded into a group's input. Plain model structure: no calibration data (jaxinfra.quant.calibration)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfra.models.layers import DecoderLayer
from jaxinfra.quant.qlinear import QuantizedLinear


@dataclasses.dataclass(frozen=True)
class InputGroup:
    """Linears that read the same activations, and what produces those activations (a norm to fold
    scales into, or a linear whose output channels can absorb them)."""

    name: str
    linears: tuple[str, ...]
    norm: str | None = None
    prev: str | None = None


GROUPS = (
    InputGroup("attn_in", ("attn.q_proj", "attn.k_proj", "attn.v_proj"), norm="input_norm"),
    InputGroup("o_in", ("attn.o_proj",), prev="attn.v_proj"),
    InputGroup("mlp_in", ("mlp.gate_proj", "mlp.up_proj"), norm="post_attn_norm"),
    InputGroup("down_in", ("mlp.down_proj",), prev="mlp.up_proj"),
)
LINEAR_NAMES = tuple(name for group in GROUPS for name in group.linears)  # every decoder linear
IN_DIMS = {"attn.o_proj": 2}  # input dims of each weight (others: 1)


def get(layer: DecoderLayer, name: str) -> nnx.Param | QuantizedLinear:
    module, attr = name.split(".")
    return getattr(getattr(layer, module), attr)


def put(layer: DecoderLayer, name: str, value: QuantizedLinear) -> None:
    module, attr = name.split(".")
    setattr(getattr(layer, module), attr, value)


def dense(layer: DecoderLayer, name: str) -> nnx.Param:
    w = get(layer, name)
    if isinstance(w, QuantizedLinear):
        raise ValueError(f"{name} is already quantized")
    return w


def shapes(layer: DecoderLayer, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input dims, output dims) of a dense weight."""
    shape = dense(layer, name).shape
    n_in = IN_DIMS.get(name, 1)
    return tuple(shape[:n_in]), tuple(shape[n_in:])


def axes(layer: DecoderLayer, name: str) -> tuple[str | None, str | None]:
    """Logical names of a dense weight's K and N (its first input and first output axis)."""
    names = dense(layer, name).get_metadata().get("logical_axes")
    if names is None:
        return None, None
    return names[0], names[IN_DIMS.get(name, 1)]


def matrix(layer: DecoderLayer, name: str) -> jax.Array:
    """The dense weight as a float32 [K, N] matrix."""
    k_dims, _ = shapes(layer, name)
    return dense(layer, name)[...].astype(jnp.float32).reshape(int(np.prod(k_dims)), -1)


def set_matrix(layer: DecoderLayer, name: str, w: jax.Array) -> None:
    param = dense(layer, name)
    param[...] = w.reshape(param.shape).astype(param.dtype)


def fold_scales(layer: DecoderLayer, group: InputGroup, s: jax.Array) -> None:
    """W rows *= s for the group's linears; the producer of their input (norm or previous linear)
    divides by s, so the float layer computes the same function (AWQ and SmoothQuant)."""
    for name in group.linears:
        set_matrix(layer, name, matrix(layer, name) * s[:, None])
    if group.norm is not None:
        norm = getattr(layer, group.norm)
        norm.scale[...] = (norm.scale[...].astype(jnp.float32) / s).astype(norm.scale.dtype)
        return
    assert group.prev is not None
    set_matrix(layer, group.prev, matrix(layer, group.prev) / s[None, :])
    bias = getattr(layer.attn, "v_bias", None) if group.prev == "attn.v_proj" else None
    if bias is not None:
        bias[...] = (bias[...].astype(jnp.float32) / s.reshape(bias.shape)).astype(bias.dtype)
