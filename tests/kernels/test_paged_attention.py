"""Paged attention kernels (interpret mode) against the gather-then-attend references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import PagedKVCache
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.paged_attention_reference import paged_attention_reference, ragged_paged_attention_reference
from pallas_kernels.paged_tiles import kernel_work_list, tile_plan
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla, tile_tokens
from pallas_kernels.split_merge import merge_splits, merge_splits_reference
from tests.kernels.paged_pools import QUANTIZED, D, Pool, query_dtype, tolerance
from tests.kernels.tolerances import f32_atol

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out


@pytest.mark.parametrize(
    "bs,h,kh,dtype,splits",
    [
        (8, 2, 2, "float32", None),  # GQA 1
        (16, 8, 2, "bfloat16", 3),  # GQA 4, split-K
        (64, 8, 1, "float32", 2),  # GQA 8, big blocks
        (16, 8, 2, "int8", None),  # int8 KV
        (16, 8, 2, "fp8", 2),  # fp8 (e4m3) KV, split-K
    ],
)
def test_decode_matches_reference(bs, h, kh, dtype, splits):
    lens = [1, 7, 33, 100, 0]  # partial last blocks; the 0 is a padding sequence
    pool = Pool(lens, bs, kh, dtype)
    q = jax.random.normal(jax.random.key(1), (len(lens), h, D), query_dtype(dtype))
    kwargs = {k: v for k, v in pool.poisoned.items()}
    ours = paged_attention(q, block_tables=pool.block_tables, context_lens=pool.kv_lens, num_splits=splits, **kwargs)
    ref = paged_attention_reference(q, block_tables=pool.block_tables, context_lens=pool.kv_lens, **pool.clean)
    assert not np.isnan(np.asarray(ours, np.float32)).any()
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref, np.float32), atol=tolerance(dtype))
    assert float(jnp.abs(ours[-1]).max()) == 0.0


@pytest.mark.parametrize(
    "bs,h,kh,dtype,window,softcap",
    [
        (8, 4, 4, "float32", None, None),
        (16, 8, 2, "bfloat16", None, None),
        (16, 8, 1, "int8", None, None),
        (16, 8, 2, "fp8", None, None),
        (8, 8, 2, "float32", 11, None),
        (8, 6, 2, "float32", None, 5.0),  # GQA 3: rows padded to 4 heads in registers only
    ],
)
def test_ragged_mixed_batch_matches_reference(bs, h, kh, dtype, window, softcap):
    q_lens = [1, 9, 1, 30, 0]  # decodes, a whole prefill, a prefill chunk, a padding sequence
    kv_lens = [13, 9, 70, 45, 0]
    pool = Pool(kv_lens, bs, kh, dtype, seed=2)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    n = sum(q_lens) + 7  # padding tokens at the end
    q = jax.random.normal(jax.random.key(3), (n, h, D), query_dtype(dtype))
    args = (pool.block_tables, cu, pool.kv_lens)
    ours = ragged_paged_attention(
        q,
        pool.poisoned["k_pool"],
        pool.poisoned["v_pool"],
        *args,
        block_q=8,
        num_splits=2,
        sliding_window=window,
        logit_softcap=softcap,
        **{k: v for k, v in pool.poisoned.items() if "scales" in k},
    )
    ref = ragged_paged_attention_reference(
        q,
        pool.clean["k_pool"],
        pool.clean["v_pool"],
        *args,
        sliding_window=window,
        logit_softcap=softcap,
        **{k: v for k, v in pool.clean.items() if "scales" in k},
    )
    assert not np.isnan(np.asarray(ours, np.float32)).any()
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref, np.float32), atol=tolerance(dtype))
    assert float(jnp.abs(ours[sum(q_lens) :]).max()) == 0.0


@pytest.mark.parametrize(
    "bs,h,kh,dtype,window,softcap",
    [
        (8, 4, 4, "float32", None, None),
        (16, 8, 2, "bfloat16", None, None),
        (16, 8, 1, "int8", None, None),
        (16, 4, 2, "fp8", None, None),
        (8, 8, 2, "float32", 11, None),
        (8, 6, 2, "float32", None, 5.0),  # GQA 3
    ],
)
@pytest.mark.parametrize("host_plan", [False, True])
def test_xla_ragged_matches_reference(bs, h, kh, dtype, window, softcap, host_plan):
    """The XLA formulation (CPU serving path) on poisoned pools: decodes, whole prompts, chunks, padding."""
    q_lens = [1, 9, 1, 30, 0]
    kv_lens = [13, 9, 70, 45, 0]
    pool = Pool(kv_lens, bs, kh, dtype, seed=2)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    n = sum(q_lens) + 7
    q = jax.random.normal(jax.random.key(3), (n, h, D), query_dtype(dtype))
    args = (pool.block_tables, jnp.asarray(cu), pool.kv_lens)
    scales = {k: v for k, v in pool.poisoned.items() if "scales" in k}
    plan = (
        tile_plan(cu, np.asarray(kv_lens, np.int32), np.asarray(pool.block_tables), bs, n, tile_tokens(n, n), np)
        if host_plan
        else None
    )
    ours = ragged_paged_attention_xla(
        q,
        pool.poisoned["k_pool"],
        pool.poisoned["v_pool"],
        *args,
        sliding_window=window,
        logit_softcap=softcap,
        plan=plan,
        **scales,
    )
    ref = ragged_paged_attention_reference(
        q,
        pool.clean["k_pool"],
        pool.clean["v_pool"],
        *args,
        sliding_window=window,
        logit_softcap=softcap,
        **{k: v for k, v in pool.clean.items() if "scales" in k},
    )
    assert not np.isnan(np.asarray(ours, np.float32)).any()
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref, np.float32), atol=tolerance(dtype))
    assert float(jnp.abs(ours[sum(q_lens) :]).max()) == 0.0


@pytest.mark.parametrize(
    "lens,seqs,tokens",
    [([1, 1, 1], 5, 1), ([3, 0, 17, 1, 8], 6, 4), ([64], 2, 16), ([0, 0], 3, 4), ([5, 5, 5, 5], 4, 2)],
)
def test_tile_plan_host_equals_device(lens, seqs, tokens):
    """tile_plan is one piece of code for numpy (host) and jax.numpy (traced): same plan either way, every
    token in exactly one tile row, rows in order, no tile more than needed."""
    cu = np.zeros(seqs + 1, np.int32)
    cu[1 : len(lens) + 1] = np.cumsum(lens)
    cu[len(lens) + 1 :] = cu[len(lens)]
    rng = np.random.default_rng(0)
    kv = np.zeros(seqs, np.int32)
    kv[: len(lens)] = np.asarray(lens) + rng.integers(0, 20, len(lens))
    tables = rng.integers(0, 50, (seqs, 6)).astype(np.int32)
    n = int(cu[-1]) + 3
    host = tile_plan(cu, kv, tables, 8, n, tokens, np)
    dev = jax.jit(lambda c, k, t: tile_plan(c, k, t, 8, n, tokens))(cu, kv, tables)
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(dev)):
        np.testing.assert_array_equal(a, np.asarray(b))
    flat = host.q_index.reshape(-1)
    assert sorted(flat[flat >= 0].tolist()) == list(range(int(cu[-1])))
    assert (host.out_index[: int(cu[-1])] >= 0).all() and (host.out_index[int(cu[-1]) :] == -1).all()
    assert (flat[host.out_index[: int(cu[-1])]] == np.arange(int(cu[-1]))).all()


@pytest.mark.parametrize(
    "d,gqa,bs,dtype,decode",
    [
        (64, 1, 16, "bfloat16", True),
        (64, 4, 64, "int8", True),
        (256, 8, 64, "fp8", True),
        (128, 4, 32, "int8", False),
        (128, 8, 16, "bfloat16", False),
        (256, 1, 32, "bfloat16", False),
        (80, 4, 16, "bfloat16", False),
        (96, 1, 32, "int8", True),
    ],
)
def test_serving_head_dims_gqa_blocks_dtypes(d, gqa, bs, dtype, decode):
    """The issue's matrix, each value at least once (head dims 64/128/256, GQA 1/4/8, pages of
    16/32/64, bf16/int8/fp8, decode and prefill), on poisoned pools, one split and three; head dims
    80 and 96 on pools of their true width."""
    kh = 2
    q_lens = [1, 1, 1, 0] if decode else [1, 37, 5, 0]
    kv_lens = [70, 1, 129, 0] if decode else [70, 37, 129, 0]
    pool = Pool(kv_lens, bs, kh, dtype, seed=16, d=d)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    n = sum(q_lens) + 2
    q = jax.random.normal(jax.random.key(17), (n, kh * gqa, d), jnp.bfloat16)
    scales = {k: v for k, v in pool.poisoned.items() if "scales" in k}
    args = (pool.block_tables, cu, pool.kv_lens)
    ref = ragged_paged_attention_reference(
        q.astype(jnp.float32),
        pool.clean["k_pool"],
        pool.clean["v_pool"],
        *args,
        **{k: v for k, v in pool.clean.items() if "scales" in k},
    )
    for splits in (1, 3):
        ours = ragged_paged_attention(
            q,
            pool.poisoned["k_pool"],
            pool.poisoned["v_pool"],
            *args,
            max_q_len=max(q_lens),
            num_splits=splits,
            **scales,
        )
        assert ours.dtype == jnp.bfloat16 and not np.isnan(np.asarray(ours, np.float32)).any()
        np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref), atol=3e-2)
        assert float(jnp.abs(ours[sum(q_lens) :].astype(jnp.float32)).max()) == 0.0


@pytest.mark.parametrize(
    "lens,seqs,tokens,n_pad",
    [([1, 1, 1], 5, 1, 2), ([3, 0, 17, 1, 8], 6, 4, 5), ([64], 2, 16, 0), ([0, 0], 3, 4, 6), ([5, 5, 5, 5], 4, 2, 1)],
)
def test_kernel_work_list_covers_every_token_once(lens, seqs, tokens, n_pad):
    """The kernel's tiles, host (numpy) and traced alike: each flat token, padding included, lies in
    exactly one tile of its own sequence (padding: sequence S); decode has exactly n tiles, tile t = token t."""
    cu = np.zeros(seqs + 1, np.int32)
    cu[1 : len(lens) + 1] = np.cumsum(lens)
    cu[len(lens) + 1 :] = cu[len(lens)]
    n = int(cu[-1]) + n_pad
    host = kernel_work_list(cu, n, tokens, np)
    np.testing.assert_array_equal(host, np.asarray(jax.jit(lambda c: kernel_work_list(c, n, tokens))(cu)))
    bounds = np.append(cu, n)
    covered = []
    for seq, start in host:
        first, q_len = bounds[seq] + start, bounds[seq + 1] - bounds[seq]
        covered += [first + i for i in range(tokens) if start + i < q_len]
        assert seq <= seqs and start % tokens == 0
    assert sorted(covered) == list(range(n))
    if tokens == 1 and all(x == 1 for x in lens):
        assert len(host) == n and [bounds[sq] + st for sq, st in host] == list(range(n))


@pytest.mark.parametrize("dtype,d", [(jnp.float32, D), (jnp.bfloat16, D), (jnp.bfloat16, 80)])
def test_merge_splits_matches_reference(dtype, d):
    """Split-K merge kernel: 3 splits over 37 rows (not a multiple of the block), some splits empty
    (lse -inf), one row empty in every split (output 0); a head dim that is not a power of two."""
    ks = jax.random.split(jax.random.key(13), 3)
    o = jax.random.normal(ks[0], (3, 37, d))
    lse = jax.random.normal(ks[1], (3, 37)) * 4
    lse = jnp.where(jax.random.bernoulli(ks[2], 0.3, (3, 37)), -jnp.inf, lse).at[:, 5].set(-jnp.inf)
    got = merge_splits(o, lse, dtype)
    want = merge_splits_reference(o, lse, dtype)
    assert got.dtype == dtype and float(jnp.abs(got[5]).max()) == 0.0
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tolerance(jnp.dtype(dtype).name)
    )
    with pytest.raises(ValueError, match="lse"):
        merge_splits(o, lse[:, :5], dtype)


def test_host_work_list_is_what_the_kernel_builds():
    """A work list built on the host (numpy, as the serving runner does) gives the kernel's own result;
    one built for another tile size is refused."""
    from pallas_kernels.ragged_paged_attention import kernel_tile_tokens

    q_lens, kv_lens = [1, 9, 0, 30], [13, 9, 0, 45]
    pool = Pool(kv_lens, 8, 2, "float32", seed=14)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    n = sum(q_lens) + 3
    q = jax.random.normal(jax.random.key(15), (n, 8, D))
    args = (q, pool.clean["k_pool"], pool.clean["v_pool"], pool.block_tables, jnp.asarray(cu), pool.kv_lens)
    tokens = kernel_tile_tokens(4, D, 30, quantized=False, block_q=8)
    work = kernel_work_list(cu, n, tokens, np)
    got = ragged_paged_attention(*args, max_q_len=30, block_q=8, work=jnp.asarray(work))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ragged_paged_attention(*args, max_q_len=30, block_q=8)))
    with pytest.raises(ValueError, match="work"):
        ragged_paged_attention(*args, max_q_len=30, block_q=8, work=jnp.asarray(kernel_work_list(cu, n, 2, np)))


def test_padding_does_not_change_real_outputs():
    pool = Pool([20, 5, 0, 0], 8, 2, "float32", seed=4)
    q = jax.random.normal(jax.random.key(5), (12, 4, D))
    bt, kv = pool.block_tables, pool.kv_lens
    fn = lambda q, cu, bt, kv: ragged_paged_attention(
        q, pool.clean["k_pool"], pool.clean["v_pool"], bt, cu, kv, block_q=4
    )
    padded = fn(q, jnp.asarray([0, 6, 8, 8, 8]), bt, kv)
    alone = fn(q[:8], jnp.asarray([0, 6, 8]), bt[:2], kv[:2])
    np.testing.assert_array_equal(np.asarray(padded[:8]), np.asarray(alone))


def test_reused_block_never_leaks_old_contents():
    """Sequence A fills a block, is freed; B reuses it for fewer tokens: B sees only its own."""
    bs, kh, h = 8, 2, 4
    cache = PagedKVCache.zeros(4, bs, kh, D, jnp.float32)
    rng = np.random.default_rng(6)
    ka, va = (jnp.asarray(rng.standard_normal((bs, kh, D)) * 5, jnp.float32) for _ in range(2))
    cache = cache.write(ka, va, jnp.arange(2 * bs, 3 * bs))  # A owns block 2, full
    kb, vb = (jnp.asarray(rng.standard_normal((3, kh, D)), jnp.float32) for _ in range(2))
    cache = cache.write(kb, vb, jnp.arange(2 * bs, 2 * bs + 3))  # B reuses block 2 for 3 tokens
    q = jax.random.normal(jax.random.key(7), (3, h, D))
    bt, cu, kv = jnp.asarray([[2]]), jnp.asarray([0, 3]), jnp.asarray([3])
    got = ragged_paged_attention(q, cache.k, cache.v, bt, cu, kv, block_q=4)
    fresh = PagedKVCache.zeros(1, bs, kh, D, jnp.float32).write(kb, vb, jnp.arange(3))
    want = ragged_paged_attention_reference(q, fresh.k, fresh.v, jnp.asarray([[0]]), cu, kv)
    np.testing.assert_allclose(got, want, atol=f32_atol(1e-5))


def test_cache_write_drops_padding_and_donates():
    cache = PagedKVCache.zeros(3, 4, 2, D, jnp.float32)
    new = jnp.ones((3, 2, D))
    write = jax.jit(lambda c, k, s: c.write(k, k * 2, s), donate_argnums=0)
    old_k = cache.k
    out = write(cache, new, jnp.asarray([5, -1, 0]))
    assert old_k.is_deleted()  # the pool was donated, not copied
    k = np.asarray(out.k).reshape(12, 2, D)
    assert (k[5] == 1).all() and (k[0] == 1).all() and k.sum() == 2 * 2 * D
    assert (np.asarray(out.v).reshape(12, 2, D)[5] == 2).all()


@pytest.mark.parametrize("slot", [6, -1])
def test_one_token_cache_write(slot):
    """A one-token write (a batch-1 decode step) lands in its slot or, as padding, nowhere; the pool
    is updated in place (XLA's one-index scatter rewrite is kept out: see `_scatter_slots`)."""
    cache = PagedKVCache.zeros(3, 4, 2, D, jnp.float32)
    before = jax.random.normal(jax.random.key(3), cache.k.shape)
    want = np.asarray(before).reshape(12, 2, D).copy()
    cache = PagedKVCache(before, -before)
    new = jax.random.normal(jax.random.key(4), (1, 2, D))
    write = jax.jit(lambda c, k, s: c.write(k, -k, s), donate_argnums=0)
    out = write(cache, new, jnp.asarray([slot]))
    assert before.is_deleted()  # donated: updated in place
    if slot >= 0:
        want[slot] = np.asarray(new[0])
    np.testing.assert_array_equal(np.asarray(out.k).reshape(12, 2, D), want)
    np.testing.assert_array_equal(np.asarray(out.v).reshape(12, 2, D), -want)


@pytest.mark.parametrize("dtype,rel", [("int8", 0.5 / 127), ("fp8", 2.0**-4)])
def test_quantized_cache_write_round_trips(dtype, rel):
    """int8: error <= half a step of amax/127; fp8 e4m3 (3 mantissa bits): relative error <= 2^-4."""
    cache = PagedKVCache.zeros(2, 4, 2, D, QUANTIZED[dtype])
    x = jax.random.normal(jax.random.key(8), (5, 2, D)) * 3
    out = cache.write(x, -x, jnp.arange(5))
    k = (out.k.astype(jnp.float32) * out.k_scale[..., None]).reshape(8, 2, D)[:5]
    assert out.k.dtype == QUANTIZED[dtype] and out.v.dtype == QUANTIZED[dtype]
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    bound = amax * rel if dtype == "int8" else jnp.maximum(jnp.abs(x) * rel, amax / 448 * 2.0**-9)
    assert bool(jnp.all(jnp.abs(k - x) <= bound * (1 + 1e-5)))
    v = (out.v.astype(jnp.float32) * out.v_scale[..., None]).reshape(8, 2, D)[:5]
    np.testing.assert_array_equal(np.asarray(v), -np.asarray(k))


def test_dispatcher_decode_and_ragged_entries():
    from pallas_kernels import PagedMetadata
    from pallas_kernels import decode_attention as dispatch_decode
    from pallas_kernels import ragged_attention as dispatch_ragged

    pool = Pool([9, 30], 8, 2, "float32", seed=8)
    cache = PagedKVCache(pool.clean["k_pool"], pool.clean["v_pool"])
    q = jax.random.normal(jax.random.key(9), (2, 4, D))
    got = {
        impl: dispatch_decode(q, cache, pool.block_tables, pool.kv_lens, impl=impl)
        for impl in ("pallas", "xla", "reference")
    }
    np.testing.assert_allclose(got["pallas"], got["reference"], atol=f32_atol(1e-5))
    np.testing.assert_allclose(got["xla"], got["reference"], atol=f32_atol(1e-5))
    cu = jnp.asarray([0, 1, 2])
    meta = PagedMetadata(jnp.full((2,), -1), pool.block_tables, cu, pool.kv_lens, max_q_len=1)
    np.testing.assert_allclose(dispatch_ragged(q, cache, meta, impl="pallas"), got["reference"], atol=f32_atol(1e-5))
    planned = PagedMetadata(
        meta.slot_mapping,
        meta.block_tables,
        cu,
        meta.kv_lens,
        1,
        tile_plan(np.asarray(cu), np.asarray(pool.kv_lens), np.asarray(pool.block_tables), 8, 2, 1, np),
    )
    np.testing.assert_allclose(dispatch_ragged(q, cache, planned, impl="xla"), got["reference"], atol=f32_atol(1e-5))
    with pytest.raises(ValueError, match="paged attention impl"):
        dispatch_decode(q, cache, pool.block_tables, pool.kv_lens, impl="cudnn")


def test_dispatcher_splits_long_decodes_and_matches_reference():
    """The serving path (ragged entry, one token per sequence) splits long contexts over the KV."""
    from pallas_kernels import PagedMetadata
    from pallas_kernels import ragged_attention as dispatch_ragged
    from pallas_kernels.paged_attention import default_num_splits

    pool = Pool([1500, 700], 16, 2, "float32", seed=11)
    assert default_num_splits(2, pool.mb, 16) > 1
    cache = PagedKVCache(pool.clean["k_pool"], pool.clean["v_pool"])
    q = jax.random.normal(jax.random.key(12), (2, 4, D))
    meta = PagedMetadata(jnp.full((2,), -1), pool.block_tables, jnp.asarray([0, 1, 2]), pool.kv_lens, max_q_len=1)
    want = paged_attention_reference(q, **pool.clean, block_tables=pool.block_tables, context_lens=pool.kv_lens)
    np.testing.assert_allclose(dispatch_ragged(q, cache, meta, impl="pallas"), want, atol=f32_atol(1e-5))
