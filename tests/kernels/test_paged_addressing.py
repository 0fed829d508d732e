"""What the paged kernel may address: pools Triton would read at negative 32-bit offsets are refused
(and engines never size one), lengths past the block table are cut at it, and tiles capped to
avoid register spills still compute the same attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention_reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention import (
    MAX_I32_ELEMENTS,
    addressable_blocks,
    check_addressable,
    ragged_paged_attention,
)
from tests.kernels.tolerances import f32_atol

S = jax.ShapeDtypeStruct
BLOCK = 16 * 8 * 128  # elements of one [16, 8, 128] block


def _abstract_call(num_blocks: int, dtype) -> None:
    pool = S((num_blocks, 16, 8, 128), dtype)
    args = [S((4, 32, 128), jnp.bfloat16), pool, pool, S((4, 8), jnp.int32), S((5,), jnp.int32), S((4,), jnp.int32)]
    kw = {}
    if dtype == jnp.int8:
        kw = dict(k_scales=S((num_blocks, 16, 8), jnp.float32), v_scales=S((num_blocks, 16, 8), jnp.float32))
    jax.eval_shape(lambda *a: ragged_paged_attention(*a, max_q_len=1, interpret=True, **kw), *args)


@pytest.mark.parametrize(
    "num_blocks,dtype,ok",
    [
        (200_000, jnp.int8, False),  # 3.3e9 elements, 3.3 GB: 32-bit offsets past 2^31
        (MAX_I32_ELEMENTS // BLOCK, jnp.int8, True),  # just under 2^31 elements
        (2**32 // BLOCK + 1, jnp.int8, True),  # just over 2^32 bytes: 64-bit offsets
        (200_000, jnp.bfloat16, True),  # 2 bytes per element: 2^31 elements are 2^32 bytes
    ],
)
def test_pools_the_gpu_would_misaddress_are_refused(num_blocks, dtype, ok):
    if ok:
        _abstract_call(num_blocks, dtype)
        check_addressable(S((num_blocks, 16, 8, 128), dtype))
    else:
        with pytest.raises(ValueError, match="32-bit offsets"):
            _abstract_call(num_blocks, dtype)


def test_addressable_blocks_caps_only_the_bad_range():
    assert addressable_blocks(200_000, BLOCK, 1) == MAX_I32_ELEMENTS // BLOCK
    assert addressable_blocks(1_000, BLOCK, 1) == 1_000
    assert addressable_blocks(400_000, BLOCK, 1) == 400_000  # > 2^32 bytes
    assert addressable_blocks(200_000, BLOCK, 2) == 200_000


def _inputs(rng, lens, bs, kh, h, d, nb, mb):
    q = jnp.asarray(rng.standard_normal((sum(lens), h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((nb, bs, kh, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((nb, bs, kh, d)), jnp.float32)
    bt = jnp.asarray(rng.permutation(nb)[: len(lens) * mb].reshape(len(lens), mb), jnp.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    return q, k, v, bt, cu


def test_lengths_past_the_block_table_are_cut_there():
    rng = np.random.default_rng(3)
    bs, kh, h, d, mb = 8, 2, 4, 32, 3
    q, k, v, bt, cu = _inputs(rng, [1, 1], bs, kh, h, d, nb=12, mb=mb)
    too_long = jnp.asarray([mb * bs + 50, 7], jnp.int32)
    cut = jnp.minimum(too_long, mb * bs)
    got = ragged_paged_attention(q, k, v, bt, cu, too_long, max_q_len=1)
    want = ragged_paged_attention_reference(q, k, v, bt, cu, cut, max_q_len=1)
    assert bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_allclose(got, want, atol=f32_atol(1e-5), rtol=0)


def test_tiles_capped_for_registers_match_the_reference():
    """head_dim 128 with 16 query heads per KV head: 8 tokens per tile instead of block_q 16."""
    rng = np.random.default_rng(4)
    bs, kh, h, d = 16, 1, 16, 128
    lens = [21, 1, 9]
    q, k, v, bt, cu = _inputs(rng, lens, bs, kh, h, d, nb=16, mb=4)
    kv_lens = jnp.asarray([40, 33, 9], jnp.int32)
    got = ragged_paged_attention(q, k, v, bt, cu, kv_lens, max_q_len=21, block_q=16)
    want = ragged_paged_attention_reference(q, k, v, bt, cu, kv_lens, max_q_len=21)
    np.testing.assert_allclose(got, want, atol=f32_atol(1e-4), rtol=0)
