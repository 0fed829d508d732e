"""Qwen3 (RMS-normalized Q and K per head) and Qwen3-MoE (Qwen2-MoE's tensors, no shared expert)."""

from typing import Any

from jaxinfra.config import ModelConfig
from jaxinfra.models.families.qwen2 import QWEN_MOE_TENSORS, qwen_attention_from_hf, qwen_moe_from_hf, qwen_moe_to_hf
from jaxinfra.models.families.registry import Family, attention_to_hf, register


def _from_hf(config: dict[str, Any]) -> dict[str, Any]:
    return {**qwen_attention_from_hf(config), "qk_norm": True}


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return attention_to_hf(cfg, qk_norm=True)


QWEN3 = register(Family("qwen3", "Qwen3ForCausalLM", _from_hf, _to_hf))
QWEN3_MOE = register(
    Family(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        lambda config: {**_from_hf(config), **qwen_moe_from_hf(config, shared=False)},
        lambda cfg: {**_to_hf(cfg), **qwen_moe_to_hf(cfg, shared=False)},
        QWEN_MOE_TENSORS,
        moe=True,
    )
)
