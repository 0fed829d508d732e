"""The jnp attention reference and the dispatcher, checked against independent naive formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ContiguousCacheMetadata, DenseMetadata, KVCache, attend, dot_product_attention, mha_reference
from tests.kernels.tolerances import f32_atol

HIGHEST = jax.lax.Precision.HIGHEST


def _qkv(b, t, s, h, kh, d, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(ks[0], (b, t, h, d), dtype),
        jax.random.normal(ks[1], (b, s, kh, d), dtype),
        jax.random.normal(ks[2], (b, s, kh, d), dtype),
    )


def _naive(q, k, v, mask):
    """Textbook attention with K/V repeated per query head and a [B, T, S] boolean mask."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k, precision=HIGHEST) / np.sqrt(q.shape[-1])
    s = jnp.where(mask[:, None], s, -1e30)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v, precision=HIGHEST)


@pytest.mark.parametrize("h,kh", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("t,s", [(77, 77), (13, 131)])
def test_gqa_causal_matches_naive(h, kh, t, s):
    q, k, v = _qkv(2, t, s, h, kh, 32)
    mask = jnp.arange(s)[None, :] <= (jnp.arange(t) + s - t)[:, None]
    want = _naive(q, k, v, jnp.broadcast_to(mask, (2, t, s)))
    np.testing.assert_allclose(mha_reference(q, k, v, causal=True), want, atol=1e-5)
    np.testing.assert_allclose(
        mha_reference(q, k, v, causal=False), _naive(q, k, v, jnp.ones((2, t, s), bool)), atol=1e-5
    )


def test_segment_ids_equal_separate_documents():
    q, k, v = _qkv(1, 30, 30, 4, 2, 16, seed=1)
    seg = jnp.asarray([[0] * 12 + [1] * 10 + [2] * 8])
    packed = mha_reference(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg)
    for lo, hi in ((0, 12), (12, 22), (22, 30)):
        alone = mha_reference(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], causal=True)
        np.testing.assert_allclose(packed[:, lo:hi], alone, atol=1e-5)


def test_sliding_window_and_softcap():
    q, k, v = _qkv(1, 20, 20, 2, 1, 8, seed=2)
    i = jnp.arange(20)
    mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 5)
    np.testing.assert_allclose(mha_reference(q, k, v, sliding_window=5), _naive(q, k, v, mask[None]), atol=1e-5)
    capped = mha_reference(q * 10, k, v, logit_softcap=2.0)
    s = jnp.einsum("bthd,bshd->bhts", q * 10, jnp.repeat(k, 2, 2), precision=HIGHEST) / np.sqrt(8)
    s = jnp.where(i[None, :] <= i[:, None], 2.0 * jnp.tanh(s / 2.0), -1e30)
    want = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), jnp.repeat(v, 2, 2), precision=HIGHEST)
    np.testing.assert_allclose(capped, want, atol=1e-5)


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = _qkv(1, 4, 4, 2, 2, 8, seed=3)
    out = mha_reference(
        q, k, v, causal=True, q_segment_ids=jnp.asarray([[5, 5, 5, 5]]), kv_segment_ids=jnp.asarray([[1, 1, 1, 1]])
    )
    assert not np.isnan(np.asarray(out)).any() and np.abs(np.asarray(out)).max() == 0


def test_xla_impl_matches_reference():
    q, k, v = _qkv(2, 33, 33, 8, 2, 16, seed=4)
    seg = jnp.asarray([[0] * 20 + [1] * 13, [0] * 33])
    for kwargs in ({}, {"q_segment_ids": seg, "kv_segment_ids": seg}, {"sliding_window": 7}):
        np.testing.assert_allclose(
            dot_product_attention(q, k, v, impl="xla", **kwargs),
            dot_product_attention(q, k, v, impl="reference", **kwargs),
            atol=f32_atol(1e-5),
        )


def test_unknown_impl_is_rejected():
    q, k, v = _qkv(1, 4, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="impl"):
        dot_product_attention(q, k, v, impl="triton")


def test_contiguous_cache_prefill_then_decode_equals_dense():
    """Writing K/V into a cache step by step and attending there equals one dense causal pass."""
    q, k, v = _qkv(2, 9, 9, 4, 2, 16, seed=5)
    dense, _ = attend(q, k, v, DenseMetadata(), impl="reference")  # the cache path runs the reference too
    cache = KVCache.zeros(2, 16, 2, 16, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    first, cache = attend(q[:, :6], k[:, :6], v[:, :6], ContiguousCacheMetadata(pos), cache)
    outs = [first]
    for i in range(6, 9):
        o, cache = attend(
            q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], ContiguousCacheMetadata(jnp.full((2, 1), i)), cache
        )
        outs.append(o)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), dense, atol=1e-5)
