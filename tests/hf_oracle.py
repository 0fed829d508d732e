"""Random-init Hugging Face `transformers` checkpoints of each supported family: our parity oracle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

# family -> (config class, architecture class, config kwargs on top of the shared tiny shape).
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama3_rope_scaling": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama2_mha_bias": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4, attention_bias=True)),
    "llama_tied_mqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=8)),
    "qwen2_bias_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3_qk_norm": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=32)),
}

# Mixture-of-experts families (tests/test_moe.py), kept out of the dense parity matrix.
MOE_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "mixtral_moe": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    ),
    "qwen2_moe_shared": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=40,
            norm_topk_prob=True,
        ),
    ),
}

BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=144,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def make_hf_model(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A tiny random model whose every weight (biases and norms too) is random, in float32."""
    config_cls, model_cls, kwargs = FAMILIES[family] if family in FAMILIES else MOE_FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**BASE, **kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)._from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save_hf_model(model: transformers.PreTrainedModel, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


def hf_logits(model: transformers.PreTrainedModel, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()
