"""Qwen2/2.5 (Q/K/V always biased, no output bias) and Qwen2-MoE (with its sigmoid-gated shared
expert); the Qwen mixture-of-experts config fields and tensor names, which Qwen3-MoE shares."""

from typing import Any

from jaxinfra.config import ModelConfig
from jaxinfra.models.families.registry import Family, TensorMap, attention_to_hf, register


def qwen_attention_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """No sliding window: Qwen's are per layer (use_sliding_window), which we refuse."""
    if config.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=true (per-layer windows) is not supported")
    return {"sliding_window": None}


def qwen_moe_from_hf(config: dict[str, Any], shared: bool) -> dict[str, Any]:
    """The MoE fields of a Qwen MoE config.json (`shared`: it may have a shared expert)."""
    return {
        "num_experts": config.get("num_experts") or config["num_local_experts"],  # transformers v5 renames it
        "num_experts_per_tok": config.get("num_experts_per_tok", 2),
        "moe_intermediate_size": config["moe_intermediate_size"],
        "shared_expert_intermediate_size": config.get("shared_expert_intermediate_size", 0) if shared else 0,
        "norm_topk_prob": bool(config.get("norm_topk_prob", not shared)),
        "decoder_sparse_step": config.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(config.get("mlp_only_layers") or ()),
    }


def qwen_moe_to_hf(cfg: ModelConfig, shared: bool) -> dict[str, Any]:
    """The MoE fields of a Qwen MoE config.json (`shared`: the shared expert's width among them)."""
    if cfg.shared_expert_intermediate_size and not shared:
        raise ValueError("a shared expert is exported only as model_type qwen2_moe")
    out: dict[str, Any] = {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
    }
    return {**out, "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size} if shared else out


def _experts(proj: str) -> TensorMap:
    return TensorMap(f"mlp.experts.{{expert}}.{proj}.weight", "linear", per_expert=True)


QWEN_MOE_TENSORS = {
    ("mlp", "router"): TensorMap("mlp.gate.weight", "linear"),
    ("mlp", "expert_gate"): _experts("gate_proj"),
    ("mlp", "expert_up"): _experts("up_proj"),
    ("mlp", "expert_down"): _experts("down_proj"),
    ("mlp", "shared", "gate_proj"): TensorMap("mlp.shared_expert.gate_proj.weight", "linear"),
    ("mlp", "shared", "up_proj"): TensorMap("mlp.shared_expert.up_proj.weight", "linear"),
    ("mlp", "shared", "down_proj"): TensorMap("mlp.shared_expert.down_proj.weight", "linear"),
    ("mlp", "shared_gate"): TensorMap("mlp.shared_expert_gate.weight", "linear"),
}


def _from_hf(config: dict[str, Any]) -> dict[str, Any]:
    return {**qwen_attention_from_hf(config), "qkv_bias": True}


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return attention_to_hf(cfg, bias_field=False)


QWEN2 = register(Family("qwen2", "Qwen2ForCausalLM", _from_hf, _to_hf))
QWEN2_MOE = register(
    Family(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        lambda config: {**_from_hf(config), **qwen_moe_from_hf(config, shared=True)},
        lambda cfg: {**_to_hf(cfg), **qwen_moe_to_hf(cfg, shared=True)},
        QWEN_MOE_TENSORS,
        moe=True,
    )
)
