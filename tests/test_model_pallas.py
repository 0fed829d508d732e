"""The model with impl="pallas" (flash attention, interpret mode) equals the reference path."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxinfra


def _loss_and_grads(impl, ids, seg):
    model = jaxinfra.load_model("tiny-qwen3", attn_impl=impl)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params):
        m = nnx.merge(graphdef, params)
        logits = m(ids[:, :-1], segment_ids=seg[:, :-1])
        mask = seg[:, 1:] == seg[:, :-1]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
        return jnp.sum(ce * mask) / jnp.sum(mask), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return value, logits, grads


def test_forward_and_gradients_match_reference():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 512, (2, 41)), jnp.int32)
    seg = jnp.asarray(np.sort(rng.integers(0, 2, (2, 41)), axis=1), jnp.int32)
    loss_p, logits_p, grads_p = _loss_and_grads("pallas", ids, seg)
    loss_r, logits_r, grads_r = _loss_and_grads("reference", ids, seg)
    np.testing.assert_allclose(logits_p, logits_r, atol=1e-4)
    np.testing.assert_allclose(loss_p, loss_r, rtol=1e-6)
    flat_p, flat_r = jax.tree.leaves(grads_p), jax.tree.leaves(grads_r)
    assert len(flat_p) == len(flat_r) > 10
    for gp, gr in zip(flat_p, flat_r):
        np.testing.assert_allclose(gp, gr, atol=1e-5 * max(1.0, float(jnp.abs(gr).max())))
