"""The C++ CPU paged-attention kernel (an XLA FFI custom call) against the gather-then-attend reference."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import PagedKVCache, PagedMetadata, paged_impl, ragged_attention
from pallas_kernels import cpu_paged_attention as cpu
from pallas_kernels.paged_attention_reference import paged_attention_reference, ragged_paged_attention_reference
from tests.check_scripts import ROOT
from tests.kernels.paged_pools import Pool

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out


def _mixed_batch(q_lens, kv_lens, bs, h, kh, d, seed, pad_tokens=5):
    pool = Pool(kv_lens, bs, kh, "float32", seed=seed, d=d)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = jax.random.normal(jax.random.key(seed), (sum(q_lens) + pad_tokens, h, d), jnp.float32)
    return pool, q, cu


@pytest.mark.parametrize(
    "bs,h,kh,d,window,softcap,scale",
    [
        (16, 4, 4, 64, None, None, None),  # the embedded model's attention
        (8, 6, 2, 24, None, None, None),  # GQA 3, a head dim that is no power of two
        (16, 8, 1, 33, 11, None, None),  # GQA 8 (one KV head), odd head dim, sliding window
        (4, 4, 2, 16, None, 5.0, 0.3),  # softcap and an explicit scale, tiny blocks
        (32, 2, 2, 128, 40, 30.0, None),  # big blocks, window and softcap together
        (16, 1, 1, 8, None, None, None),  # one head of 8 (tiny-llama-128k): transposed keys, 8-wide value sums
        (12, 8, 2, 16, 9, None, None),  # transposed keys on pages of 12 (padded to 16 lanes), window
    ],
)
def test_ragged_mixed_batch_matches_reference(bs, h, kh, d, window, softcap, scale):
    # decodes, a whole prefill longer than a work unit's 8 tokens, a chunk over a context, an empty
    # sequence and padding tokens at the end of the flat batch
    q_lens = [1, 19, 1, 30, 0, 3]
    kv_lens = [13, 19, 70, 95, 0, 40]
    pool, q, cu = _mixed_batch(q_lens, kv_lens, bs, h, kh, d, seed=3)
    args = (pool.block_tables, cu, pool.kv_lens)
    variant = dict(sliding_window=window, logit_softcap=softcap, scale=scale)
    ours = jax.jit(lambda q, k, v, *a: cpu.ragged_paged_attention_cpu(q, k, v, *a, **variant))(
        q, pool.poisoned["k_pool"], pool.poisoned["v_pool"], *args
    )
    ref = ragged_paged_attention_reference(q, pool.clean["k_pool"], pool.clean["v_pool"], *args, **variant)
    assert not np.isnan(np.asarray(ours)).any()  # no block a sequence does not own was read
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), atol=2e-5, rtol=1e-5)
    assert float(jnp.abs(ours[sum(q_lens) :]).max()) == 0.0


def assert_decode_matches_reference(lo: int, hi: int, num_seqs: int) -> None:
    """A decode batch of `num_seqs` sequences of lo..hi keys (random, seeded by num_seqs) through the
    kernel equals the gather reference."""
    rng = np.random.default_rng(num_seqs)
    lens = [int(n) for n in rng.integers(lo, hi, num_seqs)]
    pool = Pool(lens, 16, 2, "float32", seed=num_seqs, d=64)
    q = jax.random.normal(jax.random.key(num_seqs), (num_seqs, 4, 64), jnp.float32)
    cu = jnp.arange(num_seqs + 1, dtype=jnp.int32)
    ours = cpu.ragged_paged_attention_cpu(
        q, pool.poisoned["k_pool"], pool.poisoned["v_pool"], pool.block_tables, cu, pool.kv_lens
    )
    ref = paged_attention_reference(q, block_tables=pool.block_tables, context_lens=pool.kv_lens, **pool.clean)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("num_seqs", [1, 3, 37, 300])
def test_decode_batches_of_every_size_match_reference(num_seqs):
    assert_decode_matches_reference(0, 90, num_seqs)


def test_dispatcher_picks_the_cpu_kernel_and_falls_back_for_quantized_pools():
    """On CPU the default paged implementation is the C++ kernel; an int8 pool (which it does not
    read) takes the XLA formulation through the same entry, and both equal the reference."""
    assert paged_impl(None) == "cpu"
    q_lens, kv_lens = [1, 6, 1], [20, 6, 33]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = jax.random.normal(jax.random.key(0), (sum(q_lens), 4, 32), jnp.float32)
    for dtype in (jnp.float32, jnp.int8):
        pool = Pool(kv_lens, 8, 2, "int8" if dtype == jnp.int8 else "float32", seed=1, d=32)
        c = pool.clean
        cache = PagedKVCache(c["k_pool"], c["v_pool"], c.get("k_scales"), c.get("v_scales"))
        meta = PagedMetadata(jnp.zeros(sum(q_lens), jnp.int32), pool.block_tables, cu, pool.kv_lens, 6)
        ref = ragged_paged_attention_reference(
            q,
            c["k_pool"],
            c["v_pool"],
            pool.block_tables,
            cu,
            pool.kv_lens,
            k_scales=c.get("k_scales"),
            v_scales=c.get("v_scales"),
        )
        out = ragged_attention(q, cache, meta, impl="cpu")
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)


def test_bfloat16_pools_are_refused_by_name():
    pool = jnp.zeros((2, 4, 1, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="float32 pools"):
        cpu.ragged_paged_attention_cpu(
            jnp.zeros((1, 1, 8)), pool, pool, jnp.zeros((1, 2), jnp.int32), jnp.arange(2), jnp.ones(1, jnp.int32)
        )


def test_build_is_cached_per_source_and_fails_clearly_without_a_compiler(tmp_path):
    """A fresh cache folder gets a library built once; with no compiler the failure says so, and the
    default implementation then is the XLA formulation."""
    script = f"""
import os, sys
os.environ["JAXINFRA_KERNEL_CACHE"] = {str(tmp_path)!r}
from pallas_kernels import cpu_paged_attention as cpu
path = cpu.build()
assert path.exists() and str(path).startswith({str(tmp_path)!r})
assert cpu.build() == path
os.environ["JAXINFRA_KERNEL_CACHE"] = {str(tmp_path / "other")!r}
os.environ["CXX"] = "/nonexistent/c++"
try:
    cpu.build()
except cpu.KernelUnavailable:
    pass
else:
    raise SystemExit("a build without a compiler did not fail")
from pallas_kernels import paged_impl
assert paged_impl(None) == "xla", paged_impl(None)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_malformed_lengths_are_an_error_not_a_race():
    """cu_q_lens that decrease would give two work units the same output rows: the call refuses them."""
    pool = jnp.ones((4, 4, 1, 8), jnp.float32)
    with pytest.raises(Exception, match="non-decreasing"):
        jax.block_until_ready(
            cpu.ragged_paged_attention_cpu(
                jnp.ones((3, 1, 8)),
                pool,
                pool,
                jnp.zeros((2, 2), jnp.int32),
                jnp.asarray([0, 3, 1], jnp.int32),
                jnp.asarray([3, 1], jnp.int32),
            )
        )


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a spare core needs two cores")
def test_large_calls_also_run_on_the_cores_xla_leaves_out():
    """With XLA's pool one thread smaller than the machine (EngineArgs.cpu_reserved_cores), a call that
    reads many keys starts the library's own thread on the spare core and still matches the reference;
    a small call does not."""
    script = """
import os, sys
os.environ["PJRT_NPROC"] = str(len(os.sched_getaffinity(0)) - 1)
from tests.kernels.test_cpu_paged_attention import assert_decode_matches_reference as check

def threads():
    return len(os.listdir("/proc/self/task"))

check(45, 90, 5)  # compiles and runs everything a call needs, on fewer keys than the spare cores wait for
before = threads()
check(45, 90, 7)
assert threads() == before, (before, threads())
check(60, 120, 300)  # ~27k keys
assert threads() > before, (before, threads())
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
