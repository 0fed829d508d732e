"""The model-family registry: a Llama-like family declared in one place (here) builds, exports and
loads back through the registry alone (its config field, tensor names and block class)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import jaxinfra
from jaxinfra.config import ModelConfig
from jaxinfra.models import LlamaModel
from jaxinfra.models.families import FAMILIES, Family, TensorMap, family
from jaxinfra.models.layers import DecoderLayer


class ToyBlock(DecoderLayer):
    """The Llama block under another name: proves the family's block class is the one built."""


TOY = Family(
    "toy_llama",
    "ToyLlamaForCausalLM",
    config_from_hf=lambda config: {"rope_theta": float(config["toy_rope_base"])},
    config_to_hf=lambda cfg: {"toy_rope_base": cfg.rope_theta},
    tensors={("mlp", "gate_proj"): TensorMap("mlp.w_gate.weight", "linear")},
    block=ToyBlock,
)


@pytest.fixture
def toy_family(monkeypatch):
    monkeypatch.setitem(FAMILIES, TOY.model_type, TOY)
    return TOY


def test_a_family_registered_in_one_place_exports_and_loads(toy_family, tmp_path):
    cfg = ModelConfig.from_preset("tiny-llama").replace(model_type="toy_llama", rope_theta=5000.0)
    model = LlamaModel(cfg, nnx.Rngs(3))
    assert all(isinstance(layer, ToyBlock) for layer in model.layers)
    out = jaxinfra.export_hf(model, tmp_path / "toy")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["ToyLlamaForCausalLM"] and config["toy_rope_base"] == 5000.0
    tensors = load_file(str(out / "model.safetensors"))
    assert "model.layers.0.mlp.w_gate.weight" in tensors and "model.layers.0.mlp.gate_proj.weight" not in tensors
    loaded = jaxinfra.load_model(out)
    assert loaded.cfg == cfg and isinstance(loaded.layers[0], ToyBlock)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(model(ids)))


def test_every_supported_model_type_is_registered():
    assert {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"} <= set(FAMILIES)
    assert [t for t, f in sorted(FAMILIES.items()) if f.moe] == ["mixtral", "qwen2_moe", "qwen3_moe"]
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        family("gpt2")
