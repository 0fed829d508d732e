"""The compile-time kernel report (no GPU): every kernel lowers for CUDA and compiles offline for
sm_90a, and at the serving shapes (and context parallelism's flash backward, a traced query offset
at head dim 128) nothing spills and shared memory fits."""

import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks.kernel_report import S, report, table, triton_kernels
from pallas_kernels.ragged_paged_attention import ragged_paged_attention


@pytest.mark.slow
def test_serving_shapes_compile_without_spills():
    rows = report(quick=True)
    assert {r.kernel for r in rows} >= {
        "jaxinfra_ragged_paged_attention",
        "jaxinfra_flash_fwd",
        "jaxinfra_flash_dq",
        "jaxinfra_flash_dkdv",
        "jaxinfra_merge_splits",
        "jaxinfra_grouped_matmul",
        "jaxinfra_grouped_matmul_dw",
        "jaxinfra_lora_bgmv_shrink",
        "jaxinfra_lora_bgmv_expand",
        "jaxinfra_lora_sgmv_shrink",
        "jaxinfra_lora_sgmv_expand",
    }
    bad = [r for r in rows if not r.ok]
    assert not bad, table(bad)
    assert all(r.registers > 0 for r in rows)
    assert any(r.wgmma for r in rows if r.kernel == "jaxinfra_flash_fwd")
    true_width = [r for r in rows if " d80 " in r.shape or " d96 " in r.shape]  # masked loads, pipelined
    assert len(true_width) == 6 and all(r.cp_async for r in true_width)


def _ttir(num_blocks: int) -> str:
    pool = S((num_blocks, 16, 8, 128), jnp.int8)
    scales = S((num_blocks, 16, 8), jnp.float32)

    def call(q, k, v, bt, cu, lens, ks, vs):
        return ragged_paged_attention(q, k, v, bt, cu, lens, k_scales=ks, v_scales=vs, max_q_len=1, interpret=False)

    args = (S((4, 32, 128), jnp.bfloat16), pool, pool, S((4, 8), jnp.int32), S((5,), jnp.int32), S((4,), jnp.int32))
    (kernel,) = triton_kernels(call, *args, scales, scales)
    return kernel.ttir


def test_large_int8_pools_get_64_bit_offsets():
    """Past 2^32 bytes the lowering switches to 64-bit offsets (what makes refusing only the
    2^31..2^32-element range enough); small pools keep 32-bit ones."""
    assert "i64" not in _ttir(1_000)
    assert "i64" in _ttir(2**32 // (16 * 8 * 128) + 1)


def test_decode_lowers_to_kernels_only():
    """Decode moves no query or output through XLA: no gather, scatter or transpose of float data
    outside the kernels (only the int32 work list is built in XLA); one kernel writing bf16 when
    there is one split, the kernel plus its merge with split-K."""
    args = (S((8, 32, 128), jnp.bfloat16), *(S((64, 16, 8, 128), jnp.bfloat16),) * 2)
    args += (S((8, 8), jnp.int32), S((9,), jnp.int32), S((8,), jnp.int32))
    one, merged = ["jaxinfra_ragged_paged_attention"], ["jaxinfra_ragged_paged_attention", "jaxinfra_merge_splits"]
    for splits, kernels in ((1, one), (4, merged)):

        def call(q, k, v, bt, cu, lens, splits=splits):
            return ragged_paged_attention(q, k, v, bt, cu, lens, max_q_len=1, num_splits=splits, interpret=False)

        assert [k.name for k in triton_kernels(call, *args)] == kernels
        text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        moves = [line for line in text.splitlines() if re.search(r"stablehlo\.(gather|scatter|transpose)", line)]
        assert moves and not [line for line in moves if re.search(r"xbf16|xf32", line)], moves
        assert "tensor<256x128xbf16>" in text  # the kernel's [N * H, D] output, in the query dtype
