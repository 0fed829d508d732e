"""Quantized matmul kernels (interpret mode) against their jnp references, and the references against
a plain numpy reading of the storage layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quant_matmul import (
    DEQUANT_DOT_MIN_M,
    SM_COUNT,
    MatmulTiles,
    default_splits,
    default_tiles,
    int8_matmul,
    int8_matmul_pallas,
    weight_only_matmul,
    weight_only_matmul_pallas,
)
from pallas_kernels.quant_matmul_reference import (
    dequantize_weight,
    int8_matmul_reference,
    pack_int4,
    quantize_activations,
    unpack_int4,
    weight_only_matmul_reference,
)
from tests.kernels.tolerances import f32_atol

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out


def random_weight(rng, k, n, bits, group, symmetric):
    """Stored weight, scales, zero points and the dense matrix they mean (numpy, by the layout's definition)."""
    g = group or k
    groups = k // g
    scales = rng.uniform(0.005, 0.02, (groups, n)).astype(np.float32)
    if bits == 8:
        q = rng.integers(-127, 128, (k, n)).astype(np.int8)
        zeros = None
        dense = q.astype(np.float32) * np.repeat(scales, g, axis=0)
        return jnp.asarray(q), jnp.asarray(scales), zeros, dense
    u = rng.integers(0, 16, (k, n)).astype(np.uint8)
    z = np.full((groups, n), 8, np.uint8) if symmetric else rng.integers(0, 16, (groups, n)).astype(np.uint8)
    dense = (u.astype(np.float32) - np.repeat(z, g, axis=0)) * np.repeat(scales, g, axis=0)
    zeros = None if symmetric else jnp.asarray(z)
    return pack_int4(jnp.asarray(u), g), jnp.asarray(scales), zeros, dense


def test_int4_packing_layout_and_round_trip():
    """Byte j of each group holds row j (low nibble) and row j + g/2 (high nibble)."""
    rng = np.random.default_rng(0)
    u = rng.integers(0, 16, (64, 3)).astype(np.uint8)
    packed = np.asarray(pack_int4(jnp.asarray(u), 32))
    assert packed.shape == (32, 3) and packed.dtype == np.uint8
    for group in range(2):
        for j in range(16):
            row = group * 32 + j
            np.testing.assert_array_equal(packed[group * 16 + j], u[row] | (u[row + 16] << 4))
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed), 32)), u)


@pytest.mark.parametrize(
    "bits,group,symmetric",
    [(8, None, True), (8, 32, True), (4, 32, True), (4, 64, False), (4, 128, False), (4, 128, True)],
)
def test_dequantize_matches_the_layout(bits, group, symmetric):
    rng = np.random.default_rng(1)
    q, s, z, dense = random_weight(rng, 256, 48, bits, group, symmetric)
    np.testing.assert_allclose(np.asarray(dequantize_weight(q, s, z, bits=bits)), dense, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "m,k,n,bits,group,symmetric",
    [
        (1, 96, 48, 8, None, True),
        (5, 64, 80, 8, 32, True),
        (17, 128, 48, 4, 32, True),
        (3, 192, 112, 4, 64, False),
        (40, 256, 64, 4, 128, False),
        (130, 256, 32, 4, 128, True),  # large-M tiling, rows masked (the dispatcher uses XLA here)
        (1, 1024, 48, 4, 64, False),  # M=1, split-K (16 groups)
        (3, 512, 16, 8, None, True),  # per-channel int8, split-K over block_k steps
        (2, 2048, 32, 4, None, True),  # per-channel int4: one group of K rows, stepped by block_k
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_only_matmul_matches_reference(m, k, n, bits, group, symmetric, dtype):
    rng = np.random.default_rng(m + k + n)
    q, s, z, dense = random_weight(rng, k, n, bits, group, symmetric)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    ref = weight_only_matmul_reference(x, q, s, z, bits=bits)
    tol = 1e-5 if dtype == "float32" else 2e-2
    scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
    for fn in (weight_only_matmul, weight_only_matmul_pallas):
        out = fn(x, q, s, z, bits=bits)
        assert out.shape == (m, n) and out.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol * scale, rtol=0)
    if dtype == "float32":
        np.testing.assert_allclose(np.asarray(ref), np.asarray(x) @ dense, atol=1e-4 * scale, rtol=0)


def test_weight_only_matmul_explicit_tiles():
    rng = np.random.default_rng(7)
    q, s, z, _ = random_weight(rng, 128, 64, 8, None, True)
    x = jnp.asarray(rng.standard_normal((33, 128)), jnp.float32)
    tiles = MatmulTiles(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
    out = weight_only_matmul(x, q, s, z, bits=8, tiles=tiles)
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(weight_only_matmul_reference(x, q, s, z, bits=8)), atol=f32_atol(1e-4)
    )


def test_weight_only_matmul_refuses_bad_shapes():
    rng = np.random.default_rng(2)
    q, s, z, _ = random_weight(rng, 64, 40, 8, None, True)
    with pytest.raises(ValueError, match="multiple"):
        weight_only_matmul(jnp.ones((2, 64)), q, s, z, bits=8)
    q, s, z, _ = random_weight(rng, 64, 48, 8, None, True)
    with pytest.raises(ValueError, match="K=32"):
        weight_only_matmul(jnp.ones((2, 32)), q, s, z, bits=8)
    with pytest.raises(ValueError, match="bits"):
        weight_only_matmul(jnp.ones((2, 64)), q, s, z, bits=3)


def test_activation_quantization_per_token():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((6, 40)) * np.arange(1, 7)[:, None], jnp.float32)
    xq, scale = quantize_activations(x)
    assert xq.dtype == jnp.int8
    np.testing.assert_allclose(np.asarray(scale), np.abs(np.asarray(x)).max(axis=1) / 127, rtol=1e-6)
    err = np.abs(np.asarray(xq, np.float32) * np.asarray(scale)[:, None] - np.asarray(x))
    assert np.all(err <= np.asarray(scale)[:, None] / 2 + 1e-6)


@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (7, 96, 64), (70, 128, 32), (1, 1024, 32), (130, 128, 16)])
def test_int8_matmul_matches_reference(m, k, n):
    rng = np.random.default_rng(m)
    xq, xs = quantize_activations(jnp.asarray(rng.standard_normal((m, k)), jnp.float32))
    wq = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
    ws = jnp.asarray(rng.uniform(0.001, 0.01, n), jnp.float32)
    ref = int8_matmul_reference(xq, xs, wq, ws, out_dtype=jnp.float32)
    exact = (np.asarray(xq, np.int64) @ np.asarray(wq, np.int64)) * np.asarray(xs)[:, None] * np.asarray(ws)[None]
    np.testing.assert_allclose(np.asarray(ref), exact, rtol=1e-6)
    for fn in (int8_matmul, int8_matmul_pallas):
        out = fn(xq, xs, wq, ws, out_dtype=jnp.float32)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6)
    out_bf16 = int8_matmul(xq, xs, wq, ws, out_dtype=jnp.bfloat16)
    assert out_bf16.dtype == jnp.bfloat16


def test_weight_only_matmul_is_jittable():
    rng = np.random.default_rng(4)
    q, s, z, _ = random_weight(rng, 64, 32, 4, 32, False)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    f = jax.jit(lambda x: weight_only_matmul(x, q, s, z, bits=4))
    np.testing.assert_allclose(
        np.asarray(f(x)), np.asarray(weight_only_matmul_reference(x, q, s, z, bits=4)), atol=f32_atol(1e-5)
    )


def test_split_k_fills_the_sms():
    """Decode on a 4096 x 4096 layer: 32 column tiles of 128, so K splits 4 ways (128 programs of
    132 SMs) over its 32 groups; 64 prefill tiles split 2 ways, 128 not at all; a split walks >= 2 steps."""
    assert default_tiles(1, 4096, 4096, step=128) == MatmulTiles(16, 128, 64, num_warps=4, num_splits=4)
    assert default_tiles(256, 4096, 4096, step=128).num_splits == 2
    assert default_tiles(512, 4096, 4096, step=128).num_splits == 1
    assert default_splits(1, 4) == 2 and default_splits(3, 7) == 1
    for programs in (1, 8, 32, 64):
        splits = default_splits(programs, 64)
        assert 64 % splits == 0 and programs * splits <= max(SM_COUNT, programs)


@pytest.mark.parametrize("splits", [1, 2, 4, 8])
def test_weight_only_matmul_explicit_splits(splits):
    """Every split count gives the same answer, M=1 included (no padding: masked rows)."""
    rng = np.random.default_rng(11)
    q, s, z, _ = random_weight(rng, 512, 64, 4, 64, False)
    x = jnp.asarray(rng.standard_normal((1, 512)), jnp.float32)
    tiles = MatmulTiles(block_m=16, block_n=32, num_splits=splits)
    out = weight_only_matmul(x, q, s, z, bits=4, tiles=tiles)
    ref = weight_only_matmul_reference(x, q, s, z, bits=4)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=f32_atol(1e-4))
    xq, xs = quantize_activations(x)
    wq = jnp.asarray(rng.integers(-127, 128, (512, 64)), jnp.int8)
    ws = jnp.asarray(rng.uniform(0.001, 0.01, 64), jnp.float32)
    got = int8_matmul(xq, xs, wq, ws, out_dtype=jnp.float32, tiles=tiles)
    want = int8_matmul_reference(xq, xs, wq, ws, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_split_count_must_divide_the_steps():
    rng = np.random.default_rng(12)
    q, s, z, _ = random_weight(rng, 192, 32, 4, 64, False)
    with pytest.raises(ValueError, match="splits"):
        weight_only_matmul(jnp.ones((1, 192)), q, s, z, bits=4, tiles=MatmulTiles(16, 32, num_splits=2))


def test_dispatcher_switches_to_dense_past_the_threshold():
    """Below DEQUANT_DOT_MIN_M rows the kernel runs (a Pallas call in the jaxpr), from it XLA's matmul."""
    rng = np.random.default_rng(13)
    q, s, z, _ = random_weight(rng, 64, 32, 8, None, True)
    for m, kernel in ((DEQUANT_DOT_MIN_M - 1, True), (DEQUANT_DOT_MIN_M, False)):
        x = jnp.ones((m, 64), jnp.bfloat16)
        assert ("pallas_call" in str(jax.make_jaxpr(lambda x: weight_only_matmul(x, q, s, z, bits=8))(x))) == kernel
        xq = jnp.ones((m, 64), jnp.int8)
        jaxpr = jax.make_jaxpr(lambda x, xs: int8_matmul(x, xs, q, s[0], out_dtype=jnp.bfloat16))(xq, jnp.ones(m))
        assert ("pallas_call" in str(jaxpr)) == kernel
