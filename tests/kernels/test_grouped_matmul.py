"""The grouped (ragged per-expert) matmul kernel against jax.lax.ragged_dot: forward and both
gradients, in interpret mode off GPU, on odd row counts, empty groups and rows past every group."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import GroupedTiles, default_tiles, grouped_matmul, grouped_matmul_pallas
from pallas_kernels.grouped_matmul_reference import grouped_matmul_reference
from tests.kernels.tolerances import f32_atol

CASES = [  # group sizes (sum <= rows), K, N, tiles
    ([5, 0, 37, 1, 20], 48, 32, GroupedTiles(16, 16, 16)),  # empty group, groups inside one tile
    ([64, 64], 32, 64, GroupedTiles(32, 32, 16)),  # group edges on tile edges
    ([3, 9, 0, 0], 16, 16, GroupedTiles(16, 16, 16)),  # 13 of 17 rows grouped: the rest are zero
    ([70, 1, 29], 64, 48, None),  # default tiles, one 64-row tile spanning three groups
]


@pytest.mark.parametrize("sizes,k,n,tiles", CASES)
def test_forward_and_gradients_match_ragged_dot(sizes, k, n, tiles):
    m = sum(sizes) + (4 if sizes == [3, 9, 0, 0] else 0)
    gs = jnp.asarray(sizes, jnp.int32)
    kx, kw, ky = jax.random.split(jax.random.PRNGKey(len(sizes) * k + n), 3)
    x = jax.random.normal(kx, (m, k))
    w = jax.random.normal(kw, (len(sizes), k, n))
    dy = jax.random.normal(ky, (m, n))
    ours = lambda x, w: grouped_matmul_pallas(x, w, gs, tiles=tiles, interpret=True)
    ref = lambda x, w: grouped_matmul_reference(x, w, gs)
    out, vjp = jax.vjp(ours, x, w)
    ref_out, ref_vjp = jax.vjp(ref, x, w)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=f32_atol(1e-4), rtol=1e-5)
    assert not np.asarray(out[sum(sizes) :]).any()
    for got, want in zip(vjp(dy), ref_vjp(dy)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=f32_atol(1e-4), rtol=1e-5)


def test_bfloat16_is_close_and_dispatch_picks_an_impl():
    gs = jnp.asarray([7, 25], jnp.int32)
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 32), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 16), jnp.bfloat16)
    got = grouped_matmul_pallas(x, w, gs, interpret=True)
    assert got.dtype == jnp.bfloat16
    want = np.asarray(grouped_matmul_reference(x.astype(jnp.float32), w.astype(jnp.float32), gs))
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=0.1, rtol=0.02)
    np.testing.assert_array_equal(
        np.asarray(grouped_matmul(x, w, gs, impl="reference")), grouped_matmul_reference(x, w, gs)
    )
    with pytest.raises(ValueError, match="impl"):
        grouped_matmul(x, w, gs, impl="cuda")
    with pytest.raises(ValueError, match="multiples of 16"):
        default_tiles(40, 16)
