"""Quantized linears in Hugging Face checkpoints: which tensors they are, reading them into a model
being loaded, and writing them beside the dense tensors on export."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxinfra.models import LlamaModel
from jaxinfra.quant import decoder_linears as lin
from jaxinfra.quant import formats
from jaxinfra.quant.qlinear import QuantizedLinear

# Where each format's quantized linear announces itself (a dense linear has none of these).
MARKERS = {"pack-quantized": "weight_packed", "int-quantized": "weight_scale", "naive-quantized": "weight_scale"}


def _marker(qcfg: dict[str, Any]) -> str:
    if qcfg.get("quant_method") == "compressed-tensors":
        return MARKERS[formats._ct_scheme(qcfg)[2]]
    return "qweight"


def _read_prefixed(read: Callable[[str], np.ndarray], prefix: str, tensor: str) -> np.ndarray:
    return np.asarray(read(f"{prefix}.{tensor}"))


def linear_prefixes(num_layers: int, hf_name: Callable[[tuple], str]) -> Iterator[tuple[int, str, str]]:
    """(layer, our linear name, HF module prefix) for every decoder linear."""
    for i in range(num_layers):
        for name in lin.LINEAR_NAMES:
            yield i, name, hf_name(("layers", i, *name.split("."))).removesuffix(".weight")


def attach(
    model: LlamaModel,
    qcfg: dict[str, Any],
    has: Callable[[str], bool],
    read: Callable[[str], np.ndarray],
    hf_name: Callable[[tuple], str],
    dtype: Any,
) -> set[str]:
    """Replace each linear the checkpoint stores quantized (model may be abstract); returns their tensor names."""
    names = formats.tensor_names(qcfg)  # refuses methods we cannot read
    reader = formats.READERS[qcfg["quant_method"]]
    marker = _marker(qcfg)
    used: set[str] = set()
    for i, name, prefix in linear_prefixes(model.cfg.num_layers, hf_name):
        if not has(f"{prefix}.{marker}"):
            continue
        missing = [t for t in names if not has(f"{prefix}.{t}")]
        if missing:
            raise ValueError(f"quantized {prefix} lacks tensor(s) {missing}")
        layer = model.layers[i]
        in_shape, out_shape = lin.shapes(layer, name)
        neutral = reader(functools.partial(_read_prefixed, read, prefix), qcfg)
        k, n = int(np.prod(in_shape)), int(np.prod(out_shape))
        if neutral.values.shape != (k, n):
            raise ValueError(f"{prefix}: quantized weight is {list(neutral.values.shape)[::-1]}, expected [{n}, {k}]")
        linear = formats.to_quantized_linear(neutral, in_shape, out_shape, dtype, lin.axes(layer, name))
        lin.put(layer, name, linear)
        used |= {f"{prefix}.{t}" for t in names}
    return used


def quantized_tensors(
    model: LlamaModel, method: str, hf_name: Callable[[tuple], str], dtype: Any
) -> tuple[list[tuple[str, np.ndarray]], dict[str, Any] | None]:
    """The checkpoint tensors of every quantized linear (scales cast to `dtype`), and the quantization_config."""
    if method not in formats.WRITERS:
        raise ValueError(f"quantization format must be one of {tuple(formats.WRITERS)}, got {method!r}")
    tensors: list[tuple[str, np.ndarray]] = []
    config = None
    for i, name, prefix in linear_prefixes(model.cfg.num_layers, hf_name):
        ql = lin.get(model.layers[i], name)
        if not isinstance(ql, QuantizedLinear):
            continue
        neutral = formats.from_linear(ql)
        config = config or formats.write_config(neutral, method)
        for t, value in formats.WRITERS[method](neutral).items():
            if dtype is not None and np.issubdtype(value.dtype, np.floating):
                value = value.astype(dtype)
            tensors.append((f"{prefix}.{t}", np.ascontiguousarray(value)))  # safetensors writes raw buffers
    return tensors, config
