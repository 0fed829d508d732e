"""RoPE scaling equals transformers at long positions: each type HF defines for Llama-family
checkpoints (default, linear, dynamic NTK, YaRN, Llama 3.1's), read from `rope_scaling` or
`rope_parameters`, gives HF's float32 logits for tokens at positions up to 131,071; an unknown type
is an error naming it; scaled models serve as far as their scaling stretches them."""

import numpy as np
import pytest
import torch

import jaxinfra
from jaxinfra.config import ModelConfig
from tests.hf_oracle import make_hf_model, save_hf_model

LONGEST = 131_072
ROPES = {
    "default": ("llama", 131_072, None),
    "linear": ("llama", 32_768, {"rope_type": "linear", "factor": 4.0}),
    "dynamic": ("llama", 8_192, {"rope_type": "dynamic", "factor": 4.0}),
    "yarn": ("qwen2", 32_768, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32_768}),
    "yarn_mscale": (
        "llama",
        4_096,
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4_096,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 16,
            "beta_slow": 2,
        },
    ),
    "llama3": (
        "llama",
        131_072,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8_192,
        },
    ),
}
FAMILY = {"llama": "llama3_rope_scaling", "qwen2": "qwen2_bias_tied"}


def hf_model(kind: str):
    family, max_len, rope = ROPES[kind]
    return make_hf_model(FAMILY[family], max_position_embeddings=max_len, rope_theta=500_000.0, rope_scaling=rope)


@pytest.mark.parametrize("kind", list(ROPES))
@pytest.mark.parametrize("start", [0, 5_000, LONGEST - 40])
def test_logits_equal_transformers_at_long_positions(tmp_path, kind, start):
    """24 tokens placed at positions start, start + 1, ... (HF takes the same position ids; for dynamic
    NTK the longest position sets the base, as in a forward over the whole sequence)."""
    hf = hf_model(kind)
    model = jaxinfra.load_model(save_hf_model(hf, tmp_path / kind))
    ids = np.random.default_rng(start).integers(3, 300, (1, 24))
    positions = np.arange(start, start + 24)[None]
    with torch.no_grad():
        want = hf(torch.as_tensor(ids), position_ids=torch.as_tensor(positions)).logits.float().numpy()
    got = np.asarray(model(ids.astype(np.int32), positions=positions.astype(np.int32)))
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()


def test_an_unknown_rope_type_is_an_error_naming_it():
    config = {**hf_model("default").config.to_dict(), "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}
    config.pop("rope_parameters", None)
    with pytest.raises(ValueError, match=r"'longrope'.*default, linear, dynamic, yarn, llama3"):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize(
    "kind,length", [("default", 131_072), ("linear", 131_072), ("dynamic", 32_768), ("yarn", 131_072)]
)
def test_scaled_models_reach_as_far_as_their_scaling(tmp_path, kind, length):
    """vLLM's rule: linear, dynamic and YaRN stretch max_position_embeddings by the factor (YaRN from
    its original length); the engine and generate allow that much."""
    cfg = jaxinfra.load_model(save_hf_model(hf_model(kind), tmp_path / kind)).cfg
    assert cfg.context_length == length
