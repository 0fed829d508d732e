"""The Mosaic GPU flash attention forward: under Mosaic GPU's CPU interpreter against the jnp reference
(TMA copies, barriers, the producer and consumer warpgroups, the K/V ring and the online softmax run as
on the GPU; the wgmma operand forms an interpreter lacks are the only difference: P from registers,
and before jax 0.12 K transposed in shared memory), and lowered for CUDA as compiled on Hopper."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import dot_product_attention, mha_reference
from pallas_kernels.flash_attention_mgpu import MosaicBlocks, flash_attention_mgpu


def _inputs(b, t, s, h, kh, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, s, kh, d), jnp.float32).astype(jnp.bfloat16) for key in ks[1:])
    return q, k, v


@pytest.mark.parametrize(
    "b,t,s,h,kh,d,causal,blocks",
    [
        (1, 128, 320, 4, 2, 128, True, MosaicBlocks()),  # queries end-aligned, GQA 2, the ring refilled 3 times
        (2, 128, 256, 2, 1, 64, False, MosaicBlocks(block_k=128, stages=3)),  # fewer tiles than stages
        (1, 128, 64, 2, 2, 64, True, MosaicBlocks()),  # one tile; the first consumer sees none of it
    ],
)
def test_interpreted_matches_reference(b, t, s, h, kh, d, causal, blocks):
    q, k, v = _inputs(b, t, s, h, kh, d)
    got = flash_attention_mgpu(q, k, v, causal=causal, blocks=blocks, interpret=True)
    want = mha_reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal=causal)
    assert got.dtype == jnp.bfloat16 and got.shape == q.shape
    assert float(jnp.abs(got.astype(jnp.float32) - want).max()) < 2e-2


def test_no_races_between_the_producer_and_the_consumers():
    """The interpreter's happens-before race detector over the K/V ring: three refills of each slot
    under a causal mask, so the first consumer also releases tiles only the second one reads."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    q, k, v = _inputs(1, 128, 384, 2, 1, 64, seed=3)
    got = flash_attention_mgpu(q, k, v, causal=True, interpret=InterpretGPUParams(detect_races=True))
    want = mha_reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True)
    assert float(jnp.abs(got.astype(jnp.float32) - want).max()) < 2e-2
    assert not get_races().races_found


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_lowers_for_cuda(d, causal):
    """The compiled path (wgmma from a transposed K and from registers, WGMMA layouts) lowers to one
    Mosaic GPU kernel at a training shape, GQA 2."""
    q = jax.ShapeDtypeStruct((2, 2048, 16, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 2048, 8, d), jnp.bfloat16)
    fn = jax.jit(lambda q, k, v: flash_attention_mgpu(q, k, v, causal=causal, interpret=False))
    text = fn.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1


def test_refusals():
    q, k, v = _inputs(1, 128, 128, 2, 1, 64)
    with pytest.raises(ValueError, match="head_dim"):
        flash_attention_mgpu(*_inputs(1, 64, 64, 2, 1, 80))
    with pytest.raises(ValueError, match="multiple of 128"):
        flash_attention_mgpu(*_inputs(1, 64, 64, 2, 1, 64))
    with pytest.raises(ValueError, match="16-bit"):
        flash_attention_mgpu(q.astype(jnp.float32), k, v)
    with pytest.raises(ValueError, match="block_q"):
        MosaicBlocks(block_q=64)
    with pytest.raises(ValueError, match="sliding_window"):
        dot_product_attention(q, k, v, impl="mosaic", sliding_window=8)
    with pytest.raises(NotImplementedError, match="backward"):
        jax.grad(lambda q: dot_product_attention(q, k, v, impl="mosaic").astype(jnp.float32).sum())(q)
