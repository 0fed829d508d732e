"""Our model against Hugging Face `transformers` (PyTorch CPU) on random checkpoints of every family."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfra
from tests.hf_oracle import FAMILIES, hf_greedy, hf_logits, make_hf_model, save_hf_model

LOGIT_TOL = 1e-4  # float32 max abs; we measure ~6e-6 on these checkpoints.


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_checkpoint(request, tmp_path_factory):
    model = make_hf_model(request.param)
    path = save_hf_model(model, tmp_path_factory.mktemp(request.param))
    return request.param, model, path


def test_logits_match_transformers(family_checkpoint):
    _, hf_model, path = family_checkpoint
    ours = jaxinfra.load_model(path)
    ids = np.random.default_rng(1).integers(0, 300, (3, 29))
    ours_logits = np.asarray(ours(jnp.asarray(ids, jnp.int32)))
    assert ours_logits.dtype == np.float32 and ours_logits.shape == (3, 29, 300)
    np.testing.assert_allclose(ours_logits, hf_logits(hf_model, ids), atol=LOGIT_TOL, rtol=0)


@pytest.mark.slow
def test_greedy_continuations_match_transformers(family_checkpoint):
    _, hf_model, path = family_checkpoint
    ours = jaxinfra.load_model(path)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 300, n).tolist() for n in (5, 11, 2)]
    config = jaxinfra.GenerationConfig(max_new_tokens=32, stop_at_eos=False)
    got = jaxinfra.generate(ours, prompts, config)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(hf_model, prompt, 32)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,field,value",
    [
        ("mistral_window", "sliding_window", None),
        ("llama3_rope_scaling", "rope_scaling", None),
        ("qwen3_qk_norm", "qk_norm", False),
    ],
)
def test_family_features_change_logits(tmp_path, family, field, value):
    """The parity above is not vacuous: dropping the feature moves the logits far past tolerance."""
    path = save_hf_model(make_hf_model(family), tmp_path)
    model = jaxinfra.load_model(path)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 300, (1, 40)), jnp.int32)
    ref = np.asarray(model(ids))
    model.cfg = model.cfg.replace(**{field: value})
    for layer in model.layers:
        layer.attn.cfg = model.cfg
    assert np.abs(np.asarray(model(ids)) - ref).max() > 1e-2


@pytest.mark.slow
def test_bfloat16_load_is_close_to_float32(tmp_path):
    hf_model = make_hf_model("llama3_rope_scaling")
    path = save_hf_model(hf_model, tmp_path)
    model = jaxinfra.load_model(path, dtype="bfloat16")
    assert model.layers[0].attn.q_proj[...].dtype == jnp.bfloat16
    ids = np.random.default_rng(4).integers(0, 300, (2, 16))
    logits = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    assert logits.dtype == np.float32
    ref = hf_logits(hf_model, ids)
    assert np.abs(logits - ref).max() < 0.1 * np.abs(ref).max()
