"""HF checkpoint loading (single, sharded) and export round trips through `transformers`."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

import jaxinfra
from jaxinfra.cli import main as cli_main
from tests.hf_oracle import hf_logits, make_hf_model, save_hf_model


def _ids(seed=0, shape=(2, 21)):
    return np.random.default_rng(seed).integers(0, 300, shape)


def _ours(model, ids):
    return np.asarray(model(jnp.asarray(ids, jnp.int32)))


@pytest.mark.parametrize("family", ["llama2_mha_bias", "qwen3_qk_norm", "qwen2_bias_tied", "mistral_window"])
def test_export_round_trip_through_transformers(tmp_path, family):
    src = save_hf_model(make_hf_model(family), tmp_path / "src")
    model = jaxinfra.load_model(src)
    out = jaxinfra.export_hf(model, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    ids = _ids()
    np.testing.assert_allclose(hf_logits(reloaded, ids), _ours(model, ids), atol=1e-4, rtol=0)


def test_sharded_checkpoint_with_index_loads(tmp_path):
    hf_model = make_hf_model("llama3_rope_scaling")
    path = save_hf_model(hf_model, tmp_path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    ids = _ids(1)
    np.testing.assert_allclose(_ours(jaxinfra.load_model(path), ids), hf_logits(hf_model, ids), atol=1e-4, rtol=0)


def test_sharded_export_loads_in_transformers(tmp_path):
    model = jaxinfra.load_model("tiny-qwen3")
    out = jaxinfra.export_hf(model, tmp_path, max_shard_bytes=60_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    ids = _ids(2, (1, 12)) + 100
    np.testing.assert_allclose(hf_logits(reloaded, ids), _ours(model, ids), atol=1e-4, rtol=0)


def test_cli_convert_preset_loads_in_transformers(tmp_path):
    assert cli_main(["convert", "--model", "tiny-llama", "--out", str(tmp_path)]) == 0
    model = jaxinfra.load_model("tiny-llama")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    ids = _ids(3, (2, 9)) + 50
    np.testing.assert_allclose(hf_logits(reloaded, ids), _ours(model, ids), atol=1e-4, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok("héllo").input_ids == jaxinfra.load_tokenizer(tmp_path).encode("héllo")


def _rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    path = save_hf_model(make_hf_model("llama3_rope_scaling"), tmp_path)
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        jaxinfra.load_model(path)


def test_shape_mismatch_is_named(tmp_path):
    path = save_hf_model(make_hf_model("llama3_rope_scaling"), tmp_path)
    _rewrite(path, lambda t: t.__setitem__("model.norm.weight", np.ones(63, np.float32)))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \[63\], expected \[64\]"):
        jaxinfra.load_model(path)


def test_unexpected_tensor_is_named(tmp_path):
    path = save_hf_model(make_hf_model("llama3_rope_scaling"), tmp_path)
    _rewrite(path, lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", np.ones(3, np.float32)))
    with pytest.raises(ValueError, match=r"unexpected tensor.*mlp\.extra\.weight"):
        jaxinfra.load_model(path)


def test_unknown_architecture_is_rejected(tmp_path):
    path = save_hf_model(make_hf_model("llama3_rope_scaling"), tmp_path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'"):
        jaxinfra.load_model(path)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ValueError, match="neither a local directory nor a preset"):
        jaxinfra.load_model(tmp_path / "absent")
    with pytest.raises(ValueError, match="no config.json"):
        jaxinfra.load_model(tmp_path)
