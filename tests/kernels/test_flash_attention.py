"""Pallas flash attention (interpret mode) against the jnp reference: outputs and dq, dk, dv."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import BlockSizes, dot_product_attention, flash_attention, mha_reference
from tests.kernels.tolerances import f32_atol

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

SMALL = BlockSizes(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=32)


def _inputs(b, t, s, h, kh, d, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (
        jax.random.normal(key, shape, jnp.float32).astype(dtype)
        for key, shape in zip(ks, [(b, t, h, d), (b, s, kh, d), (b, s, kh, d)])
    )
    do = jax.random.normal(ks[3], (b, t, h, d), jnp.float32).astype(dtype)
    return q, k, v, do


def _segments(b, t, seed=1):
    return jnp.asarray(np.sort(np.random.default_rng(seed).integers(0, 3, (b, t)), axis=1), jnp.int32)


def _check(q, k, v, do, tol, blocks=SMALL, **kwargs):
    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, **kwargs).astype(jnp.float32) * do.astype(jnp.float32))

    ours = flash_attention(q, k, v, block_sizes=blocks, **kwargs)
    ref = mha_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), **kwargs)
    assert ours.dtype == q.dtype and ours.shape == q.shape
    scale = max(1.0, float(jnp.abs(ref).max()))
    assert float(jnp.abs(ours.astype(jnp.float32) - ref).max()) <= tol * scale
    grads = jax.grad(loss(lambda *a, **kw: flash_attention(*a, block_sizes=blocks, **kw)), argnums=(0, 1, 2))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.grad(loss(mha_reference), argnums=(0, 1, 2))(*f32)
    for name, g, w in zip("qkv", grads, want):
        assert g.dtype == q.dtype, name
        scale = max(1.0, float(jnp.abs(w).max()))
        err = float(jnp.abs(g.astype(jnp.float32) - w).max())
        assert err <= tol * scale, f"d{name}: {err} > {tol} * {scale}"


@pytest.mark.parametrize(
    "t,s,h,kh,causal",
    [
        (77, 77, 4, 4, True),  # MHA, odd length
        (77, 131, 8, 2, True),  # GQA 4, more keys than queries (queries at the end)
        (64, 64, 8, 1, False),  # MQA / GQA 8, non-causal
        (40, 40, 6, 2, True),  # GQA 3: not a power of two, heads tiled one by one
    ],
)
def test_matches_reference_fp32(t, s, h, kh, causal):
    q, k, v, do = _inputs(2, t, s, h, kh, 32, jnp.float32)
    _check(q, k, v, do, 1e-5, causal=causal)


@pytest.mark.parametrize("causal", [True, False])
def test_segment_ids(causal):
    q, k, v, do = _inputs(2, 50, 50, 8, 2, 32, jnp.float32, seed=2)
    seg = _segments(2, 50)
    _check(q, k, v, do, 1e-5, causal=causal, q_segment_ids=seg, kv_segment_ids=seg)


@pytest.mark.parametrize("offset", [0, 13, 40, 96])
def test_traced_query_offset_matches_positions(offset):
    """A chunk of 37 queries at key positions offset .. offset + 36 of 133 keys (a device's share of
    a sequence split over devices), the offset traced: equals the reference given those positions."""
    t, s = 37, 133
    q, k, v, do = _inputs(2, t, s, 8, 2, 32, jnp.float32, seed=5)
    seg = _segments(2, s, seed=6)
    q_seg = jax.lax.dynamic_slice_in_dim(seg, offset, t, axis=1)
    positions = dict(
        q_positions=jnp.broadcast_to(jnp.arange(t) + offset, (2, t)),
        kv_positions=jnp.broadcast_to(jnp.arange(s), (2, s)),
    )

    def ours(q, k, v, off):
        out = flash_attention(q, k, v, q_offset=off, q_segment_ids=q_seg, kv_segment_ids=seg, block_sizes=SMALL)
        return jnp.sum(out * do), out

    def ref(q, k, v):
        out = mha_reference(q, k, v, q_segment_ids=q_seg, kv_segment_ids=seg, **positions)
        return jnp.sum(out * do), out

    (_, out), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2), has_aux=True))(q, k, v, jnp.int32(offset))
    (_, want), want_grads = jax.value_and_grad(ref, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    np.testing.assert_allclose(out, want, atol=f32_atol(1e-5) * float(jnp.abs(want).max()))
    for name, g, w in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(g, w, atol=f32_atol(1e-5) * max(1.0, float(jnp.abs(w).max())), err_msg=f"d{name}")


def test_sliding_window_softcap_and_segments():
    q, k, v, do = _inputs(1, 45, 45, 4, 1, 32, jnp.float32, seed=3)
    seg = _segments(1, 45, seed=4)
    _check(q * 3, k, v, do, 1e-5, sliding_window=9, logit_softcap=5.0, q_segment_ids=seg, kv_segment_ids=seg)


def test_bfloat16_default_blocks_head_dim_64():
    q, k, v, do = _inputs(1, 130, 130, 4, 2, 64, jnp.bfloat16, seed=5)
    _check(q, k, v, do, 2e-2, blocks=None)


@pytest.mark.parametrize("d", [40, 80, 96])
def test_head_dims_that_are_not_powers_of_two(d):
    """Read and written at their true width (masked, padded in registers only): forward and grads."""
    q, k, v, do = _inputs(1, 20, 27, 4, 2, d, jnp.float32, seed=6)
    _check(q, k, v, do, 1e-5, causal=d != 80)


def test_dispatcher_selects_pallas():
    q, k, v, _ = _inputs(1, 24, 24, 4, 2, 16, jnp.float32, seed=7)
    np.testing.assert_allclose(
        dot_product_attention(q, k, v, impl="pallas"), mha_reference(q, k, v), atol=f32_atol(1e-5)
    )


def test_bad_arguments():
    with pytest.raises(ValueError, match="block_k"):
        BlockSizes(block_k=24)
    q, k, v, _ = _inputs(1, 8, 8, 3, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="multiple of num kv heads"):
        flash_attention(q, k, v)
    q, k, v, _ = _inputs(1, 8, 8, 4, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="together"):
        flash_attention(q, k, v, q_segment_ids=jnp.zeros((1, 8), jnp.int32))


@pytest.mark.parametrize("causal", [True, False])
def test_unmasked_and_masked_kv_loops(causal):
    """Key tiles wholly before a query tile's first position (causal) or wholly real (not causal)
    take the forward's unmasked loop, the rest the masked one: odd lengths (keys padded), queries
    starting mid-tile (offset 38), a softcap in both loops; causal tiles run last-first."""
    q, k, v, do = _inputs(1, 45, 83, 4, 2, 32, jnp.float32, seed=5)
    _check(q, k, v, do, 1e-5, causal=causal, logit_softcap=20.0)
