"""Quantized checkpoints vLLM reads, in and out: compressed-tensors (pack-quantized, int-quantized
W8A8), AutoAWQ GEMM and GPTQ (v1 zero points), all as `quantization_config` in config.json.

Every format is translated to and from one neutral form per linear: integer values [K, N] on our grid
(int8 signed, int4 nibbles 0..15) in input-feature order, scales and zero points [G, N], and g_idx
(the group of each input feature). HF stores linears [out, in]; K is `in`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxinfra.quant.qlinear import QuantizedLinear
from jaxinfra.quant.rtn import QuantScheme, to_linear
from pallas_kernels.quant_matmul_reference import SYMMETRIC_ZERO, unpack_int4

QUANT_METHODS = ("compressed-tensors", "awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i of a word holds column AWQ_ORDER[i]


@dataclasses.dataclass
class Neutral:
    """One quantized linear between formats. values are in input order; g_idx maps input -> group."""

    values: np.ndarray  # [K, N] int32: int8 signed (bits 8) or nibbles 0..15 (bits 4)
    scales: np.ndarray  # [G, N]
    zeros: np.ndarray | None  # [G, N] on the values' grid; None = symmetric (0 or 8)
    g_idx: np.ndarray  # [K] int32
    bits: int
    act_bits: int | None = None

    @property
    def group_size(self) -> int:
        return self.values.shape[0] // self.scales.shape[0]

    @property
    def zero_grid(self) -> np.ndarray:
        """Zero points with the symmetric default filled in."""
        return (
            np.full(self.scales.shape, SYMMETRIC_ZERO[self.bits], np.int32)
            if self.zeros is None
            else self.zeros.astype(np.int32)
        )

    @property
    def act_order(self) -> bool:
        return bool(np.any(self.g_idx != np.arange(len(self.g_idx)) // self.group_size))


def from_linear(ql: QuantizedLinear) -> Neutral:
    q = np.asarray(ql.qweight[...])
    g = ql.group_size
    values = np.asarray(unpack_int4(jnp.asarray(q), g)) if ql.bits == 4 else q
    values = values.astype(np.int32)
    k = values.shape[0]
    g_idx = np.arange(k, dtype=np.int32) // g
    if ql.perm is not None:  # stored row r is input perm[r]
        perm = np.asarray(ql.perm[...])
        order = np.empty_like(perm)
        order[perm] = np.arange(k)
        values, g_idx = values[order], g_idx[order]
    zeros = None if ql.zeros is None else np.asarray(ql.zeros[...]).astype(np.int32)
    return Neutral(values, np.asarray(ql.scales[...]), zeros, g_idx.astype(np.int32), ql.bits, ql.act_bits)


def to_quantized_linear(
    n: Neutral,
    in_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    dtype: Any,
    axes: tuple[str | None, str | None] = (None, None),
) -> QuantizedLinear:
    """Rows are reordered by group when g_idx is not sequential (act-order), kept as the layer's perm."""
    k = n.values.shape[0]
    perm = None
    values = n.values
    if n.act_order:
        perm = np.argsort(n.g_idx, kind="stable").astype(np.int32)
        counts = np.bincount(n.g_idx, minlength=n.scales.shape[0])
        if np.any(counts != n.group_size):
            raise ValueError(f"g_idx groups are not all of size {n.group_size}")
        values = values[perm]
    symmetric = n.zeros is None or bool(np.all(n.zeros == SYMMETRIC_ZERO[n.bits]))
    if n.bits == 8 and not symmetric:
        raise ValueError("8-bit weights with zero points are not supported (symmetric int8 only)")
    group = n.group_size
    scheme = QuantScheme(
        bits=n.bits,
        group_size=None if group == k else group if group in (32, 64, 128) else _unsupported(group),
        symmetric=symmetric,
        act_bits=n.act_bits,
    )
    return to_linear(
        jnp.asarray(values),
        jnp.asarray(n.scales, jnp.float32),
        jnp.asarray(n.zero_grid),
        scheme,
        in_shape=in_shape,
        out_shape=out_shape,
        dtype=dtype,
        perm=None if perm is None else jnp.asarray(perm),
        axes=axes,
    )


def _unsupported(group: int) -> int:
    raise ValueError(f"group size {group} is not supported (32, 64, 128 or per channel)")


# --- bit packing into int32 words (little end first) -------------------------------------------------
def pack_rows(u: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned values [R, C] -> int32 [R * bits / 32, C]: row i of each run of 32/bits in bits i*bits."""
    per = 32 // bits
    r, c = u.shape
    if r % per:
        raise ValueError(f"{r} rows do not pack into int32 words of {per}")
    u = u.astype(np.uint32).reshape(r // per, per, c)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :, None]
    return np.bitwise_or.reduce(u << shifts, axis=1).view(np.int32)


def unpack_rows(p: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    w = p.view(np.uint32)[:, None, :]
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :, None]
    return ((w >> shifts) & ((1 << bits) - 1)).reshape(-1, p.shape[1]).astype(np.int32)


def _cols(pack: Callable[[np.ndarray, int], np.ndarray], x: np.ndarray, bits: int) -> np.ndarray:
    return pack(x.T, bits).T


# --- compressed-tensors -----------------------------------------------------------------------------
def _ct_scheme(qcfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    groups = list(qcfg.get("config_groups", {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: expected one config group, got {len(groups)}")
    group = groups[0]
    fmt = group.get("format") or qcfg.get("format")
    if fmt not in ("pack-quantized", "int-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (pack-quantized, int-quantized)")
    weights = group.get("weights") or {}
    if weights.get("type", "int") != "int" or weights.get("num_bits") not in (4, 8):
        raise ValueError(f"compressed-tensors: weights {weights} are not int4/int8")
    return weights, group.get("input_activations"), fmt


def ct_tensor_names(qcfg: dict[str, Any]) -> tuple[str, ...]:
    weights, _, fmt = _ct_scheme(qcfg)
    names: tuple[str, ...] = ("weight", "weight_scale")
    if fmt == "pack-quantized":
        names = ("weight_packed", "weight_scale", "weight_shape")
    if not weights.get("symmetric", True):
        names += ("weight_zero_point",)
    if weights.get("actorder") == "group":
        names += ("weight_g_idx",)
    return names


def ct_read(read: Callable[[str], np.ndarray], qcfg: dict[str, Any]) -> Neutral:
    weights, acts, fmt = _ct_scheme(qcfg)
    bits = weights["num_bits"]
    offset = 1 << (bits - 1)  # compressed-tensors stores signed values; ours are offset for int4
    if fmt == "pack-quantized":
        k = int(read("weight_shape")[1])
        q = unpack_rows(np.ascontiguousarray(read("weight_packed").T), bits)[:k] - offset
    else:
        q = read("weight").astype(np.int32).T
        k = q.shape[0]
    scales = np.ascontiguousarray(read("weight_scale").T)  # [G, N]
    zeros = None
    if not weights.get("symmetric", True):
        zp = unpack_rows(read("weight_zero_point"), bits)[: q.shape[1]] - offset  # packed along out
        zeros = (zp.T + SYMMETRIC_ZERO[bits]).astype(np.int32)
    values = q + 8 if bits == 4 else q
    g = k // scales.shape[0]
    g_idx = read("weight_g_idx").astype(np.int32) if weights.get("actorder") == "group" else np.arange(k) // g
    act_bits = 8 if acts else None
    return Neutral(values.astype(np.int32), scales, zeros, g_idx.astype(np.int32), bits, act_bits)


def ct_write(n: Neutral) -> dict[str, np.ndarray]:
    k, out = n.values.shape
    if n.act_bits == 8:
        return {"weight": n.values.T.astype(np.int8), "weight_scale": np.ascontiguousarray(n.scales.T)}
    offset = 1 << (n.bits - 1)
    signed = n.values - 8 if n.bits == 4 else n.values
    tensors = {
        "weight_packed": np.ascontiguousarray(pack_rows(signed + offset, n.bits).T),
        "weight_scale": np.ascontiguousarray(n.scales.T),
        "weight_shape": np.array([out, k], np.int64),
    }
    if n.zeros is not None:
        zp = n.zeros - SYMMETRIC_ZERO[n.bits]
        tensors["weight_zero_point"] = pack_rows(np.ascontiguousarray(zp.T) + offset, n.bits)
    if n.act_order:
        tensors["weight_g_idx"] = n.g_idx.astype(np.int32)
    return tensors


def ct_config(n: Neutral, version: str) -> dict[str, Any]:
    k = n.values.shape[0]
    per_channel = n.group_size == k
    weights = {
        "num_bits": n.bits,
        "type": "int",
        "symmetric": n.zeros is None,
        "strategy": "channel" if per_channel else "group",
        "group_size": None if per_channel else n.group_size,
        "dynamic": False,
        "actorder": "group" if n.act_order else None,
        "observer": "minmax",
    }
    acts = None
    if n.act_bits == 8:
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    fmt = "int-quantized" if n.act_bits == 8 else "pack-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": acts,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "version": version,
    }


# --- AutoAWQ GEMM ---------------------------------------------------------------------------------
def _awq_pack(u: np.ndarray) -> np.ndarray:
    """[R, N] nibbles -> int32 [R, N/8] in AutoAWQ's interleaved column order."""
    r, n = u.shape
    cols = u.reshape(r, n // 8, 8)[:, :, list(AWQ_ORDER)]
    return _cols(pack_rows, cols.reshape(r, n), 4)


def _awq_unpack(p: np.ndarray) -> np.ndarray:
    u = _cols(unpack_rows, p, 4).reshape(p.shape[0], -1, 8)
    return u[:, :, np.argsort(AWQ_ORDER)].reshape(p.shape[0], -1)


def awq_read(read: Callable[[str], np.ndarray], qcfg: dict[str, Any]) -> Neutral:
    if qcfg.get("bits", 4) != 4 or str(qcfg.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"awq: only 4-bit GEMM checkpoints are supported, got {qcfg}")
    values = _awq_unpack(read("qweight"))
    scales = read("scales")
    zeros = _awq_unpack(read("qzeros")) if qcfg.get("zero_point", True) else None
    g_idx = np.arange(values.shape[0], dtype=np.int32) // (values.shape[0] // scales.shape[0])
    return Neutral(values, scales, zeros, g_idx, 4)


def awq_write(n: Neutral) -> dict[str, np.ndarray]:
    if n.bits != 4 or n.act_order or n.act_bits:
        raise ValueError("the awq format holds 4-bit weight-only linears without act-order")
    return {"qweight": _awq_pack(n.values), "qzeros": _awq_pack(n.zero_grid), "scales": n.scales}


def awq_config(n: Neutral) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": n.group_size, "zero_point": True, "version": "gemm"}


# --- GPTQ (v1: zero points stored minus one) ------------------------------------------------------
def gptq_read(read: Callable[[str], np.ndarray], qcfg: dict[str, Any]) -> Neutral:
    bits = qcfg.get("bits", 4)
    if bits not in (4, 8) or qcfg.get("checkpoint_format", "gptq") != "gptq":
        raise ValueError(f"gptq: only 4/8-bit checkpoint_format 'gptq' is supported, got {qcfg}")
    u = unpack_rows(read("qweight"), bits)
    scales = read("scales")
    zeros = _cols(unpack_rows, read("qzeros"), bits)[:, : u.shape[1]] + 1
    g_idx = read("g_idx").astype(np.int32)
    if bits == 8:  # unsigned with zero 128 -> our signed int8
        if np.any(zeros != 128):
            raise ValueError("gptq: 8-bit weights with zero points other than 128 are not supported")
        return Neutral(u - 128, scales, None, g_idx, 8)
    return Neutral(u, scales, None if qcfg.get("sym", True) else zeros, g_idx, 4)


def gptq_write(n: Neutral) -> dict[str, np.ndarray]:
    if n.act_bits:
        raise ValueError("the gptq format holds weight-only linears")
    if n.zeros is not None and np.any(n.zeros == 0):
        raise ValueError("the gptq format (v1) cannot store a zero point of 0; use awq or compressed-tensors")
    u, zeros = (n.values + 128, np.full(n.scales.shape, 128)) if n.bits == 8 else (n.values, n.zero_grid)
    return {
        "qweight": pack_rows(u, n.bits),
        "qzeros": _cols(pack_rows, zeros - 1, n.bits),
        "scales": n.scales,
        "g_idx": n.g_idx.astype(np.int32),
    }


def gptq_config(n: Neutral) -> dict[str, Any]:
    k = n.values.shape[0]
    return {
        "quant_method": "gptq",
        "bits": n.bits,
        "group_size": -1 if n.group_size == k else n.group_size,
        "desc_act": n.act_order,
        "sym": n.zeros is None,
        "checkpoint_format": "gptq",
    }


READERS = {"compressed-tensors": ct_read, "awq": awq_read, "gptq": gptq_read}
WRITERS = {"compressed-tensors": ct_write, "awq": awq_write, "gptq": gptq_write}


def tensor_names(qcfg: dict[str, Any]) -> tuple[str, ...]:
    """The tensors each quantized linear has in a checkpoint with this quantization_config."""
    method = qcfg.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not one of {QUANT_METHODS}")
    if method == "compressed-tensors":
        return ct_tensor_names(qcfg)
    return ("qweight", "qzeros", "scales") + (("g_idx",) if method == "gptq" else ())


def write_config(n: Neutral, method: str) -> dict[str, Any]:
    """quantization_config for a model whose linears all look like `n`."""
    if method == "compressed-tensors":
        import importlib.metadata

        try:
            version = importlib.metadata.version("compressed-tensors")
        except importlib.metadata.PackageNotFoundError:
            version = "0.10.0"
        return ct_config(n, version)
    return awq_config(n) if method == "awq" else gptq_config(n)
