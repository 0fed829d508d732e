"""Quantized linear layers: the stored form of a quantized weight and the one `linear` the model calls.

A model weight keeps its logical shape (e.g. q_proj [E, H, D]); quantized, it is a [K, N] matrix over
the flattened input and output dims (K = E, N = H * D), in the layout of
pallas_kernels.quant_matmul_reference. The model calls `linear(spec, x, w)` for every projection:
an einsum for a dense nnx.Param, the quantized matmul (Pallas on GPU, dequantize + dot elsewhere)
for a QuantizedLinear.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from jaxinfra.models.mixed_precision import weight_einsum
from pallas_kernels.dispatch import default_impl
from pallas_kernels.quant_matmul import int8_matmul, weight_only_matmul
from pallas_kernels.quant_matmul_reference import (
    dequantize_weight,
    int8_matmul_reference,
    quantize_activations,
    weight_only_matmul_reference,
)
from sharding import per_device, sharded_axes

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)  # int4 groups the kernels take (per-channel int4 is stored as 128-row groups)


class QuantParam(nnx.Variable):
    """An array of a quantized weight (packed values, scales, zero points, row order): not trained."""


class QuantizedLinear(nnx.Module):
    """y = x @ W for a quantized W [K, N]; `act_bits=8` also quantizes activations per token (W8A8).

    `perm` (GPTQ act-order) lists, for each stored row, the input feature it belongs to. `axes` names
    K and N logically (the dense weight's first input and first output axis) for sharding."""

    def __init__(
        self,
        qweight: jax.Array,
        scales: jax.Array,
        zeros: jax.Array | None,
        *,
        bits: int,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        act_bits: int | None = None,
        perm: jax.Array | None = None,
        impl: str | None = None,
        axes: tuple[str | None, str | None] = (None, None),
    ) -> None:
        if bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {bits}")
        if act_bits not in (None, 8) or (act_bits == 8 and (bits != 8 or zeros is not None or scales.shape[0] != 1)):
            raise ValueError("act_bits=8 (W8A8) needs symmetric per-channel int8 weights")
        k, n = math.prod(in_shape), math.prod(out_shape)
        rows = qweight.shape[0] * (2 if bits == 4 else 1)
        if (rows, qweight.shape[1]) != (k, n):
            raise ValueError(f"{bits}-bit weight of stored shape {qweight.shape} does not cover [{k}, {n}]")
        k_axis, n_axis = axes  # logical names of K and N: tensor parallelism shards them as the dense weight
        group_axes = (k_axis if scales.shape[0] > 1 else None, n_axis)
        self.qweight = QuantParam(qweight, logical_axes=(k_axis, n_axis))
        self.scales = QuantParam(scales, logical_axes=group_axes)
        self.zeros = None if zeros is None else QuantParam(zeros, logical_axes=group_axes)
        self.perm = None if perm is None else QuantParam(perm.astype(jnp.int32), logical_axes=(None,))
        self.bits = bits
        self.act_bits = act_bits
        self.in_shape = tuple(in_shape)
        self.out_shape = tuple(out_shape)
        self.impl = impl

    @property
    def group_size(self) -> int:
        return math.prod(self.in_shape) // self.scales.shape[0]

    @property
    def nbytes(self) -> int:
        arrays = [self.qweight, self.scales, self.zeros, self.perm]
        return sum(a[...].nbytes for a in arrays if a is not None)

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> Float[Array, "K N"]:
        """The dense [K, N] weight in the original input order."""
        zeros = None if self.zeros is None else self.zeros[...]
        w = dequantize_weight(self.qweight[...], self.scales[...], zeros, bits=self.bits, dtype=dtype)
        if self.perm is None:
            return w
        return jnp.zeros_like(w).at[self.perm[...]].set(w)

    def __call__(self, x: jax.Array) -> jax.Array:
        lead = x.shape[: x.ndim - len(self.in_shape)]
        x2 = x.reshape(-1, math.prod(self.in_shape))
        if self.perm is not None:
            x2 = jnp.take(x2, self.perm[...], axis=1)
        pallas = (self.impl or default_impl()) == "pallas"
        k_axis, n_axis = self.qweight.get_metadata()["logical_axes"]
        scale_axes = self.scales.get_metadata()["logical_axes"]
        k, n = x2.shape[1], self.qweight.shape[1]
        if self.act_bits == 8:
            xq, xs = quantize_activations(x2)  # per token over all of K (XLA reduces across K shards)
            matmul = int8_matmul if pallas else int8_matmul_reference
            args = [xq, xs, self.qweight[...], self.scales[...][0]]
            names = [(None, k_axis), (None,), (k_axis, n_axis), (n_axis,)]

            def compute(*arrays: jax.Array) -> jax.Array:
                xq, xs, qw, s = arrays
                return matmul(xq, xs, qw, s, out_dtype=x.dtype)

        else:
            wo_matmul = weight_only_matmul if pallas else weight_only_matmul_reference
            args = [x2, self.qweight[...], self.scales[...]]
            names = [(None, k_axis), (k_axis, n_axis), scale_axes]
            if self.zeros is not None:
                args.append(self.zeros[...])
                names.append(scale_axes)

            def compute(*arrays: jax.Array) -> jax.Array:
                x2, qw, s, *z = arrays
                return wo_matmul(x2, qw, s, z[0] if z else None, bits=self.bits)

        k_axes, k_parts = sharded_axes(k_axis, k)
        if self.scales.shape[0] > 1 and (k // k_parts) % self.group_size:
            # a device's rows of K would not be whole groups (scales, packed pairs): XLA splits it
            y = compute(*args)
        else:  # each device its columns (N split) or its rows of K (then summed across devices)

            def local(*arrays: jax.Array) -> jax.Array:
                y = compute(*arrays)
                return jax.lax.psum(y, k_axes) if k_axes else y

            y = per_device(local, args, names, result=((None, n_axis), (x2.shape[0], n)))
        return y.reshape(*lead, *self.out_shape)


class WrappedLinear(nnx.Module):
    """A weight with more computation around its projection (jaxinfra.lora's adapters): w(spec, x)."""

    def __call__(self, spec: str, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """The projection; `key`: randomness for its dropout, if it has any (ForwardOptions.dropout_key)."""
        raise NotImplementedError


Weight = nnx.Param | QuantizedLinear | WrappedLinear


def linear(spec: str, x: jax.Array, w: Weight, key: jax.Array | None = None) -> jax.Array:
    """A projection: `jnp.einsum(spec, x, w)` for a dense weight, the quantized matmul for a quantized
    one, and a wrapped weight's own call."""
    if isinstance(w, QuantizedLinear):
        return w(x)
    if isinstance(w, WrappedLinear):
        return w(spec, x, key)
    return weight_einsum(spec, x, w[...])
