"""ModelConfig: presets, HF config.json (transformers v4 and v5 styles), validation."""

import jax
import numpy as np
import pytest
from flax import nnx

import jaxinfra
from jaxinfra.config import ModelConfig, RopeScaling, list_presets
from jaxinfra.models import LlamaModel

REAL_SHAPES = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b": 7_241_732_096,
}


def test_presets_exist():
    assert {"tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", *REAL_SHAPES} <= set(list_presets())


@pytest.mark.parametrize("name", list_presets())
def test_param_count_matches_built_model(name):
    """The analytic count equals the parameters the model really allocates (abstractly, no memory)."""
    cfg = ModelConfig.from_preset(name)
    abstract = nnx.eval_shape(lambda: LlamaModel(cfg, nnx.Rngs(0)))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert n == cfg.num_params
    if name in REAL_SHAPES:
        assert n == REAL_SHAPES[name]  # the published parameter counts
    if not cfg.num_experts:  # the weights a token multiplies by: all but an untied embedding table
        table = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
        assert cfg.num_matmul_params == n - table


def test_from_hf_v4_style_rope_scaling():
    cfg = ModelConfig.from_hf(
        {
            "model_type": "llama",
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "rope_theta": 5e5,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "eos_token_id": [3, 4],
            "torch_dtype": "bfloat16",
        }
    )
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == RopeScaling(factor=32.0)
    assert cfg.eos_token_id == (3, 4) and cfg.dtype == "bfloat16" and cfg.head_dim == 4


def test_from_hf_v5_style_and_export_round_trip():
    from transformers import Qwen3Config

    hf = Qwen3Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ).to_dict()
    cfg = ModelConfig.from_hf(hf)
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.head_dim == 16
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"model_type": "gpt2"}, "unsupported model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type"),  # (yarn is supported now)
    ],
)
def test_from_hf_rejects_unsupported(bad, match):
    base = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**base, **bad})


@pytest.mark.parametrize(
    "field,value",
    [("num_heads", 0), ("hidden_size", -1), ("num_kv_heads", 3), ("dtype", "int8"), ("sliding_window", 0)],
)
def test_invalid_values_name_the_field(field, value):
    cfg = ModelConfig.from_preset("tiny-llama")
    with pytest.raises(ValueError, match=field):
        cfg.replace(**{field: value})


def test_unknown_yaml_field_and_preset(tmp_path):
    (tmp_path / "m.yaml").write_text("vocab_size: 10\nhidden_sise: 8\n")
    with pytest.raises(ValueError, match="hidden_sise"):
        ModelConfig.from_yaml(tmp_path / "m.yaml")
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.from_preset("nope")


def test_kv_bytes_per_token():
    cfg = jaxinfra.load_config("llama-3.1-8b")
    assert cfg.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2  # 128 KiB, the known Llama-3-8B figure
