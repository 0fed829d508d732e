"""`quantize_model`: one entry for RTN, AWQ, GPTQ and SmoothQuant, with every argument checked before any work."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxinfra.config import ModelConfig
from jaxinfra.models import LlamaModel
from jaxinfra.models.layers import DecoderLayer
from jaxinfra.quant import calibration as cal
from jaxinfra.quant import decoder_linears as lin
from jaxinfra.quant.awq import awq_layer
from jaxinfra.quant.gptq import gptq, hessian
from jaxinfra.quant.qlinear import BITS
from jaxinfra.quant.rtn import QuantScheme, rtn, to_linear
from jaxinfra.quant.smoothquant import smooth_layer
from jaxinfra.tokenizer import Tokenizer
from jaxinfra.yaml_config import build_dataclass, load_mapping

METHODS = ("rtn", "awq", "gptq", "smoothquant")


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """What `jaxinfra quantize` runs (configs/quant/*.yaml; CLI flags override).

    group_size 0 means one scale per output channel. calibration None = the KJV training split."""

    method: str = "rtn"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    calibration: str | None = None
    num_samples: int = 64
    seq_len: int = 256
    seed: int = 0
    smoothquant_alpha: float = 0.5
    gptq_damp: float = 0.01
    gptq_act_order: bool = False
    awq_grid: int = 20

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits!r}")
        if self.method == "smoothquant" and (self.bits != 8 or self.group_size or not self.symmetric):
            raise ValueError("method smoothquant is W8A8: bits=8, group_size=0 (per channel), symmetric")
        for name in ("num_samples", "seq_len", "awq_grid"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not 0 <= self.smoothquant_alpha <= 1:
            raise ValueError(f"smoothquant_alpha must be in [0, 1], got {self.smoothquant_alpha}")
        if not 0 < self.gptq_damp < 1:
            raise ValueError(f"gptq_damp must be in (0, 1), got {self.gptq_damp}")
        if self.calibration is not None and not Path(self.calibration).exists():
            raise ValueError(f"calibration: {self.calibration} does not exist")
        self.scheme()  # group size and symmetry checks

    @property
    def calibrated(self) -> bool:
        return self.method != "rtn"

    def scheme(self) -> QuantScheme:
        return QuantScheme(
            bits=self.bits,
            group_size=self.group_size or None,
            symmetric=self.symmetric,
            act_bits=8 if self.method == "smoothquant" else None,
        )


def load_quantize_config(
    path: str | Path | None, flags: dict[str, Any] | None = None, overrides: Sequence[str] = ()
) -> QuantizeConfig:
    """A QuantizeConfig from YAML (configs/quant/*.yaml), then flags, then key=value overrides."""
    data = load_mapping(path, flags, overrides)
    if data.get("method") == "smoothquant":  # W8A8's defaults
        data.setdefault("bits", 8)
        data.setdefault("group_size", 0)
    return build_dataclass(QuantizeConfig, data)


def check_format(cfg: QuantizeConfig, fmt: str) -> None:
    """The checkpoint format can hold what the method makes."""
    if fmt == "awq" and (cfg.bits != 4 or cfg.method == "smoothquant"):
        raise ValueError("format awq holds 4-bit weight-only models (use compressed-tensors or gptq)")
    if fmt == "gptq" and cfg.method == "smoothquant":
        raise ValueError("format gptq holds weight-only models; W8A8 (smoothquant) needs compressed-tensors")
    if fmt == "gptq" and not cfg.symmetric:
        raise ValueError("format gptq stores zero points minus one (v1): use awq or compressed-tensors for zero points")


def input_widths(model_cfg: ModelConfig) -> dict[str, int]:
    """K of every decoder linear."""
    e, attn, m = model_cfg.hidden_size, model_cfg.num_heads * model_cfg.head_dim, model_cfg.intermediate_size
    widths = {name: e for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    return {**widths, "attn.o_proj": attn, "mlp.down_proj": m}


def check(model_cfg: ModelConfig, cfg: QuantizeConfig, documents_given: bool = False) -> None:
    """Every linear's width fits the scheme, and the calibration data exists (before any work)."""
    if model_cfg.num_experts > 0:
        raise ValueError(
            f"quantization: {model_cfg.model_type} is a mixture-of-experts model; the quantizers round dense "
            "MLPs only (expert weights are not supported yet)"
        )
    scheme = cfg.scheme()
    for name, k in input_widths(model_cfg).items():
        scheme.check_width(k, name)
    if cfg.calibrated and cfg.calibration is None and not documents_given and not cal.DEFAULT_CALIBRATION.is_file():
        cal.calibration_documents(None)  # raises with how to get the default corpus


def _replace(layer: DecoderLayer, name: str, q, scale, zero, scheme: QuantScheme) -> None:
    in_shape, out_shape = lin.shapes(layer, name)
    dtype = jnp.dtype(layer.attn.cfg.dtype)
    axes = lin.axes(layer, name)
    linear = to_linear(q, scale, zero, scheme, in_shape=in_shape, out_shape=out_shape, dtype=dtype, axes=axes)
    lin.put(layer, name, linear)


def quantize_model(
    model: LlamaModel, tokenizer: Tokenizer | None, cfg: QuantizeConfig, documents: list[str] | None = None
) -> LlamaModel:
    """Quantize every decoder linear in place (embeddings and LM head stay in the model's dtype).
    The tokenizer reads the calibration text (RTN needs none): `documents`, else cfg.calibration."""
    check(model.cfg, cfg, documents_given=documents is not None)
    scheme = cfg.scheme()
    if not cfg.calibrated:
        for layer in model.layers:
            for name in lin.LINEAR_NAMES:
                _replace(layer, name, *rtn(lin.matrix(layer, name), scheme), scheme)
        return model
    if tokenizer is None:
        raise ValueError(f"method {cfg.method} needs a tokenizer for its calibration data")
    seq_len = min(cfg.seq_len, model.cfg.max_position_embeddings)
    docs = documents if documents is not None else cal.calibration_documents(cfg.calibration)
    rows = cal.calibration_rows(docs, tokenizer, cfg.num_samples, seq_len, cfg.seed)

    def awq(layer: DecoderLayer, capture) -> None:
        ratios = awq_layer(layer, capture, scheme)
        for name in lin.LINEAR_NAMES:
            _replace(layer, name, *rtn(lin.matrix(layer, name), scheme, ratios.get(name)), scheme)

    def run_gptq(layer: DecoderLayer, capture) -> None:
        for group in lin.GROUPS:  # sequential: each group sees the inputs the quantized ones before it give
            h = hessian(capture()[group.name])
            for name in group.linears:
                q, scale, zero = gptq(
                    lin.matrix(layer, name), h, scheme, damp=cfg.gptq_damp, act_order=cfg.gptq_act_order
                )
                _replace(layer, name, q, scale, zero, scheme)

    def smoothquant(layer: DecoderLayer, capture) -> None:
        smooth_layer(layer, capture, cfg.smoothquant_alpha)
        for name in lin.LINEAR_NAMES:
            _replace(layer, name, *rtn(lin.matrix(layer, name), scheme), scheme)

    fn = {"awq": awq, "gptq": run_gptq, "smoothquant": smoothquant}[cfg.method]
    cal.walk_layers(model, rows, fn, desc=f"{cfg.method} {cfg.bits}-bit")
    return model
