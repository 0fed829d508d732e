"""Mistral (one sliding window for every layer) and Mixtral, its mixture of experts (block_sparse_moe:
w1 = gate, w3 = up, w2 = down; config.json names the experts' width intermediate_size)."""

from typing import Any

from jaxinfra.config import ModelConfig
from jaxinfra.models.families.registry import Family, TensorMap, attention_to_hf, register


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return attention_to_hf(cfg, sliding_window=True)


def _mixtral_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "num_experts": config["num_local_experts"],
        "num_experts_per_tok": config.get("num_experts_per_tok", 2),
        "norm_topk_prob": True,
    }


def _mixtral_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = _to_hf(cfg)
    if cfg.shared_expert_intermediate_size or not cfg.norm_topk_prob or cfg.decoder_sparse_step != 1:
        raise ValueError("mixtral export needs no shared expert, norm_topk_prob and every layer sparse")
    if cfg.mlp_only_layers:
        raise ValueError("mixtral export needs mlp_only_layers empty")
    return {
        **out,
        "intermediate_size": cfg.moe_intermediate_size,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
    }


def _experts(proj: str) -> TensorMap:
    return TensorMap(f"block_sparse_moe.experts.{{expert}}.{proj}.weight", "linear", per_expert=True)


MISTRAL = register(Family("mistral", "MistralForCausalLM", config_to_hf=_to_hf))
MIXTRAL = register(
    Family(
        "mixtral",
        "MixtralForCausalLM",
        _mixtral_from_hf,
        _mixtral_to_hf,
        {
            ("mlp", "router"): TensorMap("block_sparse_moe.gate.weight", "linear"),
            ("mlp", "expert_gate"): _experts("w1"),
            ("mlp", "expert_up"): _experts("w3"),
            ("mlp", "expert_down"): _experts("w2"),
        },
        moe=True,
    )
)
