"""The model-family registry: for each HF model_type, how its config.json maps to ModelConfig and
back, where its decoder-layer tensors live, and its decoder block. Llama's is the base the others vary."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np

from jaxinfra import config
from jaxinfra.config import ModelConfig
from jaxinfra.models.layers import DecoderLayer


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """How one of our parameters is stored in HF: its name and layout.

    kind "same": identical shape; "flat": HF flattens it; "linear": HF's nn.Linear [out, in] where
    our first `n_in` dims are the input and the rest the output. `per_expert`: our leading axis is
    the experts, each slice stored as its own tensor (`{expert}` in the name) in that layout.
    """

    hf_name: str
    kind: str
    n_in: int = 1
    per_expert: bool = False

    def hf_names(self, shape: tuple[int, ...]) -> list[str]:
        """The HF tensors that hold this parameter (one per expert when `per_expert`)."""
        return [self.hf_name.format(expert=i) for i in range(shape[0])] if self.per_expert else [self.hf_name]

    def slice_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Our shape of what one HF tensor holds."""
        return shape[1:] if self.per_expert else shape

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.kind == "same":
            return shape
        if self.kind == "flat":
            return (math.prod(shape),)
        return (math.prod(shape[self.n_in :]), math.prod(shape[: self.n_in]))

    def to_ours(self, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return w.T.reshape(shape) if self.kind == "linear" else w.reshape(shape)

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        if self.kind == "linear":
            return np.ascontiguousarray(w.reshape(math.prod(w.shape[: self.n_in]), -1).T)
        return w.reshape(self.hf_shape(w.shape))


def _no_fields(_: Any) -> dict[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class Family:
    """One HF model_type. `config_from_hf`: the ModelConfig fields it reads from config.json beyond
    Llama's (overriding them); `config_to_hf`: its own config.json fields, raising for what it cannot
    express; `tensors`: decoder-layer parameters stored under other names than Llama's."""

    model_type: str
    architecture: str  # the transformers class written on export
    config_from_hf: Callable[[dict[str, Any]], dict[str, Any]] = _no_fields
    config_to_hf: Callable[[ModelConfig], dict[str, Any]] = _no_fields
    tensors: Mapping[tuple[str, ...], TensorMap] = dataclasses.field(default_factory=dict)
    block: Callable[..., DecoderLayer] = DecoderLayer  # (cfg, rngs, attn_impl, layer index) -> decoder layer
    moe: bool = False  # a mixture-of-experts type (ModelConfig.num_experts > 0)


# the registry ModelConfig reads (jaxinfra.config.FAMILIES), seen with this module's full Family type
FAMILIES = cast(dict[str, Family], config.FAMILIES)


def register(family: Family) -> Family:
    """Add a family to the registry (a module under jaxinfra/models/families registers itself on import)."""
    FAMILIES[family.model_type] = family
    return family


def attention_to_hf(
    cfg: ModelConfig, *, bias_field: bool = True, qk_norm: bool = False, sliding_window: bool = False
) -> dict[str, Any]:
    """Llama-style attention's config.json fields, raising for what they cannot express. `bias_field`:
    attention_bias sets Q/K/V and output biases alike (else Q/K/V always biased, the output never:
    Qwen2); `qk_norm`: Q and K RMS-normalized per head; `sliding_window`: one window for every layer."""
    if not bias_field and (not cfg.qkv_bias or cfg.o_bias):
        raise ValueError(f"{cfg.model_type} export needs qkv_bias=true and o_bias=false")
    if bias_field and cfg.qkv_bias != cfg.o_bias:
        raise ValueError(f"{cfg.model_type} export needs qkv_bias == o_bias (attention_bias)")
    if cfg.qk_norm != qk_norm:
        raise ValueError("qk_norm is exported only as model_type qwen3 / qwen3_moe")
    if cfg.sliding_window is not None and not sliding_window:
        raise ValueError("sliding_window is exported only as model_type mistral / mixtral")
    out: dict[str, Any] = {"attention_bias": cfg.o_bias} if bias_field else {}
    return {**out, "sliding_window": cfg.sliding_window} if sliding_window else out
