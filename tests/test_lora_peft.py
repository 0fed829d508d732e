"""LoRA adapters against Hugging Face `peft` on a tiny random Llama: ours -> PEFT and PEFT -> ours give
the same logits (float32), merge equals the adapter, and bad configs are refused by field."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxinfra
from jaxinfra.lora import LoraConfig, add_lora, load_peft, lora_layers, merge_lora, save_peft, unload_lora
from tests.hf_oracle import hf_logits, make_hf_model, save_hf_model

LOGIT_TOL = 1e-4
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = np.random.default_rng(3).integers(0, 300, (2, 17))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    hf = make_hf_model("llama3_rope_scaling")
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("base"))


def _randomize(model, seed=0):
    """Non-zero B (and new A) in every adapter, so the adapters change the logits."""
    rng = np.random.default_rng(seed)
    for _, w in lora_layers(model):
        w.lora_a.value = jnp.asarray(0.3 * rng.standard_normal(w.lora_a.shape), jnp.float32)
        w.lora_b.value = jnp.asarray(0.3 * rng.standard_normal(w.lora_b.shape), jnp.float32)


def test_ours_loads_in_peft_with_equal_logits(base, tmp_path):
    from peft import PeftModel

    hf, path = base
    ours = add_lora(jaxinfra.load_model(path), LoraConfig(4, 8.0, 0.1, TARGETS), nnx.Rngs(0))
    _randomize(ours)
    save_peft(ours, tmp_path / "adapter", base_model=str(path))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and sorted(config["target_modules"]) == sorted(TARGETS)
    want = np.asarray(ours(jnp.asarray(IDS, jnp.int32)))
    peft_model = PeftModel.from_pretrained(make_hf_model("llama3_rope_scaling"), tmp_path / "adapter").eval()
    got = hf_logits(peft_model, IDS)
    diff = float(np.abs(want - got).max())
    print(f"ours -> peft: max |logit diff| {diff:.2e}")
    assert diff <= LOGIT_TOL
    assert np.abs(want - hf_logits(hf, IDS)).max() > 1e-2  # the adapters matter


def test_peft_loads_in_ours_with_equal_logits(base, tmp_path):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    _, path = base
    torch.manual_seed(1)
    peft_cfg = PeftLoraConfig(r=6, lora_alpha=12, lora_dropout=0.0, target_modules=["q_proj", "o_proj", "down_proj"])
    peft_model = get_peft_model(make_hf_model("llama3_rope_scaling"), peft_cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn_like(p))
    peft_model.save_pretrained(tmp_path / "adapter")
    ours = load_peft(jaxinfra.load_model(path), tmp_path / "adapter")
    assert {p[-1] for p, _ in lora_layers(ours)} == {"q_proj", "o_proj", "down_proj"}
    got = np.asarray(ours(jnp.asarray(IDS, jnp.int32)))
    diff = float(np.abs(got - hf_logits(peft_model.eval(), IDS)).max())
    print(f"peft -> ours: max |logit diff| {diff:.2e}")
    assert diff <= LOGIT_TOL
    merged = np.asarray(merge_lora(ours)(jnp.asarray(IDS, jnp.int32)))
    assert not lora_layers(ours)
    np.testing.assert_allclose(merged, got, atol=LOGIT_TOL, rtol=0)


def test_unload_restores_the_base_and_fresh_adapters_change_nothing(base):
    _, path = base
    plain = np.asarray(jaxinfra.load_model(path)(jnp.asarray(IDS, jnp.int32)))
    model = add_lora(jaxinfra.load_model(path), LoraConfig(target_modules=("q_proj", "up_proj")), nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(model(jnp.asarray(IDS, jnp.int32))), plain)  # B starts at zero
    _randomize(model)
    np.testing.assert_array_equal(np.asarray(unload_lora(model)(jnp.asarray(IDS, jnp.int32))), plain)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(rank=0), "lora.rank"),
        (dict(rank=-2), "lora.rank"),
        (dict(target_modules=("qkv_proj",)), "lora.target_modules"),
        (dict(use_rslora=True), "lora.use_rslora"),
        (dict(dropout=1.0), "lora.dropout"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoraConfig(**kwargs)


def test_peft_config_we_cannot_run_is_refused(base, tmp_path):
    _, path = base
    model = add_lora(jaxinfra.load_model(path), LoraConfig(), nnx.Rngs(0))
    save_peft(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    with pytest.raises(ValueError, match="use_rslora"):
        load_peft(jaxinfra.load_model(path), tmp_path)


def test_dropout_only_with_a_key_and_by_it(base):
    """LoRA dropout is an explicit forward input (ForwardOptions.dropout_key): without a key the adapters
    are deterministic (evaluation, serving); a key drops their inputs, the same key the same way."""
    import jax

    from jaxinfra.models import ForwardOptions

    _, path = base
    ours = add_lora(jaxinfra.load_model(path), LoraConfig(4, 8.0, 0.5, TARGETS), nnx.Rngs(0))
    _randomize(ours)
    ids = jnp.asarray(IDS, jnp.int32)
    run = lambda key: np.asarray(ours(ids, options=ForwardOptions(dropout_key=key)))
    plain, k1, k1_again, k2 = run(None), run(jax.random.key(1)), run(jax.random.key(1)), run(jax.random.key(2))
    np.testing.assert_array_equal(plain, np.asarray(ours(ids)))
    np.testing.assert_array_equal(k1, k1_again)
    assert np.abs(k1 - plain).max() > 1e-3 and np.abs(k1 - k2).max() > 1e-3
