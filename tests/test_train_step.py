"""The train step on one device: remat options, microbatching and bf16 compute keep the maths."""

import jax
import numpy as np
import pytest

import jaxinfra
from jaxinfra.train import OptimConfig, TrainConfig, Trainer
from sharding import MeshConfig, get_rules, make_mesh

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out


def _batch():
    ids = np.random.default_rng(0).integers(0, 512, (4, 25))
    return dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=np.ones((4, 24), np.int32))


def _loss_grads(optim: OptimConfig = OptimConfig(), **cfg):
    trainer = Trainer(
        jaxinfra.load_model("tiny-qwen3"),
        make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]),
        get_rules("dp"),
        TrainConfig(optim, **{"compute_dtype": "float32", **cfg}),
    )
    state = trainer.init_state()
    loss, grads = trainer.gradients(state, trainer.shard_batch(_batch()))
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)], trainer, state


def test_remat_and_microbatches_do_not_change_the_maths():
    loss, grads, _, _ = _loss_grads()
    for cfg in ({"remat": "full"}, {"remat": "save_dots"}, {"microbatches": 4}):
        other_loss, other_grads, _, _ = _loss_grads(**cfg)
        assert abs(other_loss - loss) <= 1e-5 * abs(loss), cfg
        for a, b in zip(grads, other_grads):
            np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, np.abs(b).max()))


def test_bf16_compute_keeps_fp32_masters_and_learns():
    _, _, trainer, state = _loss_grads(
        OptimConfig(learning_rate=3e-3, warmup_steps=1, total_steps=30), compute_dtype="bfloat16"
    )
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(state.params))
    batch = trainer.shard_batch(_batch())
    losses = []
    for _ in range(30):
        state, m = trainer.step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(state.params))


def test_bad_train_config():
    with pytest.raises(ValueError, match="remat"):
        TrainConfig(remat="some")
    with pytest.raises(ValueError, match="microbatches"):
        TrainConfig(microbatches=0)
