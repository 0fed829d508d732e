"""Mixture-of-experts models (Mixtral, Qwen2-MoE with a shared expert, Qwen3-MoE) against
`transformers` on random checkpoints, the paged engine's greedy outputs against its generate, and the
router's dispatch (capacity, statistics)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxinfra
from jaxinfra.config import ModelConfig
from jaxinfra.models import ForwardOptions, moe
from jaxinfra.train import OptimConfig, TrainConfig, Trainer
from serve import EngineArgs, LLMEngine, SamplingParams
from sharding import MeshConfig, get_rules, make_mesh
from tests.hf_oracle import MOE_FAMILIES, hf_greedy, hf_logits, make_hf_model, save_hf_model

LOGIT_TOL = 1e-4  # float32 max abs, as for the dense families


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def family_checkpoint(request, tmp_path_factory):
    model = make_hf_model(request.param)
    return request.param, model, save_hf_model(model, tmp_path_factory.mktemp(request.param))


def test_logits_match_transformers_and_export_round_trips(family_checkpoint, tmp_path):
    family, hf_model, path = family_checkpoint
    ours = jaxinfra.load_model(path)
    assert ours.cfg.num_experts == MOE_FAMILIES[family][2].get("num_experts", 4)
    ids = np.random.default_rng(1).integers(0, 300, (2, 23))
    logits = np.asarray(jax.jit(lambda x: ours(x))(jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(logits, hf_logits(hf_model, ids), atol=LOGIT_TOL, rtol=0)
    for layer in ours.layers:  # parity is not vacuous: the other top-k weighting moves the logits
        if isinstance(layer.mlp, moe.MoE):
            layer.mlp.normalize = not layer.mlp.normalize
    flipped = np.asarray(jax.jit(lambda x: ours(x))(jnp.asarray(ids, jnp.int32)))
    assert np.abs(flipped - logits).max() > 1e-2
    for layer in ours.layers:
        if isinstance(layer.mlp, moe.MoE):
            layer.mlp.normalize = not layer.mlp.normalize
    if family == "qwen2_moe_shared":  # the sparse/dense layer choice, shared expert and its gate
        assert isinstance(ours.layers[0].mlp, moe.MoE) and not isinstance(ours.layers[1].mlp, moe.MoE)
        assert ours.layers[0].mlp.shared is not None
    import transformers

    exported = jaxinfra.export_hf(ours, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).float().eval()
    np.testing.assert_allclose(hf_logits(reloaded, ids), logits, atol=LOGIT_TOL, rtol=0)


def test_paged_engine_greedy_matches_transformers_generate(tmp_path):
    hf_model = make_hf_model("qwen2_moe_shared", seed=4)
    path = save_hf_model(hf_model, tmp_path)
    args = EngineArgs(
        model=str(path),
        block_size=8,
        max_model_len=128,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_gpu_blocks_override=32,
    )
    eng = LLMEngine(jaxinfra.load_model(path), None, args)
    rng = np.random.default_rng(5)
    batch = [rng.integers(3, 300, n).tolist() for n in (5, 19, 11)]  # no pad id (0): HF would mask it
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, prompt in enumerate(batch):
        eng.add_request(str(i), prompt, params)
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    for i, prompt in enumerate(batch):
        assert list(done[str(i)].outputs[0].token_ids) == hf_greedy(hf_model, prompt, 10)


def test_capacity_drops_overflow_copies_in_token_order():
    experts = jnp.asarray([[0, 1], [0, 2], [0, 1], [3, 0]])  # expert 0 gets 4 copies, capacity 2
    d = moe.dispatch(experts, 4, capacity=2)
    np.testing.assert_array_equal(np.asarray(d.counts), [4, 2, 1, 1])
    np.testing.assert_array_equal(np.asarray(d.group_sizes), [2, 2, 1, 1])
    # the first two copies of expert 0 (tokens 0 and 1) are kept; tokens 2 and 3's copies of 0 dropped
    np.testing.assert_array_equal(np.asarray(d.kept).reshape(4, 2), [[1, 1], [1, 1], [0, 1], [1, 0]])
    np.testing.assert_array_equal(np.asarray(d.order[:6]), [0, 2, 1, 5, 3, 6])
    dropless = moe.dispatch(experts, 4, capacity=None)
    assert dropless.kept is None and int(dropless.group_sizes.sum()) == 8


def test_router_stats_and_capacity_in_the_forward():
    cfg = ModelConfig.from_preset("tiny-mixtral")
    layer = moe.MoE(cfg, nnx.Rngs(0))
    h = jax.random.normal(jax.random.PRNGKey(1), (2, 16, cfg.hidden_size))
    dropless, s = layer(h, ForwardOptions(router_stats=True))
    assert s is not None
    assert int(s.counts.sum()) == 32 * cfg.num_experts_per_tok
    logits = np.asarray(jnp.einsum("ne,ex->nx", h.reshape(32, -1), layer.router[...]), np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, : cfg.num_experts_per_tok]
    counts = np.bincount(top.reshape(-1), minlength=cfg.num_experts)
    np.testing.assert_array_equal(np.asarray(s.counts), counts)
    # transformers' load_balancing_loss_func: experts x sum_e (copies_e / tokens) x mean probability_e
    np.testing.assert_allclose(float(s.aux_loss), cfg.num_experts * np.sum(counts / 32 * probs.mean(0)), rtol=1e-5)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(float(s.z_loss), np.mean(lse**2), rtol=1e-5)
    dropped, _ = layer(h, ForwardOptions(capacity_factor=0.5))
    roomy, _ = layer(h, ForwardOptions(capacity_factor=100.0))
    np.testing.assert_allclose(np.asarray(roomy), np.asarray(dropless), atol=1e-6)
    assert np.abs(np.asarray(dropped) - np.asarray(dropless)).max() > 1e-3
    with pytest.raises(ValueError, match="capacity_factor"):
        ForwardOptions(capacity_factor=0.0)


def _train_step(scan_layers: bool, remat: str) -> tuple[dict, tuple]:
    """One step's metrics, and the objective and its parts at the initial weights."""
    trainer = Trainer(
        jaxinfra.load_model("tiny-qwen3-moe"),
        make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]),
        get_rules("dp"),
        TrainConfig(OptimConfig(), compute_dtype="float32", scan_layers=scan_layers, remat=remat, microbatches=2),
    )
    ids = np.random.default_rng(0).integers(0, 512, (4, 17))
    batch = trainer.shard_batch(dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=np.ones((4, 16), np.int32)))
    state = trainer.init_state()
    objective = jax.device_get(jax.jit(trainer._loss)(state.params, batch))
    _, metrics = trainer.step(state, batch)
    return jax.device_get(metrics), objective


@pytest.mark.slow
def test_training_records_router_losses_and_expert_load():
    scanned, (objective, parts) = _train_step(True, "none")
    looped, _ = _train_step(False, "full")  # stats leave remat'd, unscanned layers too
    assert scanned["expert_tokens"].shape == (2, 8)  # [MoE layers, experts]
    assert scanned["expert_tokens"].sum() == 2 * 64 * 2  # layers x tokens x top-k
    np.testing.assert_array_equal(scanned["expert_tokens"], looped["expert_tokens"])
    for key in ("loss", "moe_aux_loss", "moe_z_loss", "expert_imbalance"):
        np.testing.assert_allclose(scanned[key], looped[key], rtol=1e-5)
    assert scanned["moe_aux_loss"] > 0 and scanned["expert_imbalance"] >= 1.0
    # the objective the gradients come from: cross-entropy + the weighted router losses
    penalty = 0.01 * parts["moe_aux_loss"] + 0.001 * parts["moe_z_loss"]
    np.testing.assert_allclose(float(objective), float(parts["ce"] + penalty), rtol=1e-6)
    assert float(penalty) > 1e-3 * float(parts["ce"])


def test_quantizing_an_moe_model_is_a_clear_error():
    """The quantizers round dense MLPs only: an MoE model is refused before any work, for the quantize
    command and for serving's on-the-fly --quantization alike."""
    from jaxinfra.quant.quantize import QuantizeConfig, check

    with pytest.raises(ValueError, match="mixture-of-experts"):
        check(ModelConfig.from_preset("tiny-mixtral"), QuantizeConfig())
    with pytest.raises(ValueError, match="mixture-of-experts"):
        jaxinfra.load_model("tiny-qwen3-moe", quantization="int8")
