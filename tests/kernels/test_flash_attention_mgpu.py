"""The Mosaic GPU flash attention, forward and backward: under Mosaic GPU's CPU interpreter against the
jnp reference (TMA copies, barriers, the producer and consumer warpgroups, the rings and the online
softmax run as on the GPU; the wgmma operand forms an interpreter lacks are the only difference: A
operands from registers, accumulators initialised from registers, and before jax 0.12 transposed
shared-memory operands), lowered for CUDA as compiled on Hopper, and compiled on a GPU when one runs."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import dot_product_attention, mha_reference
from pallas_kernels.flash_attention_mgpu import MosaicBlocks, flash_attention_mgpu

# The interpreter's checks run in the newest-jax kernel suite (`make test-kernels-newest`): jax < 0.12's interpreter
# lacks the transposed wgmma operand and its race detector missed a race 0.12's finds, so under it they would cost
# CI minutes for less. On a GPU they would spend gpu_check's kernel-test budget, and the compiled test runs there.
interpreted = pytest.mark.skipif(
    jax.default_backend() == "gpu" or jax.__version_info__ < (0, 12),
    reason="interpreter checks run on jax >= 0.12 off a GPU (make test-kernels-newest); a GPU runs the compiled test",
)


def _inputs(b, t, s, h, kh, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, s, kh, d), jnp.float32).astype(jnp.bfloat16) for key in ks[1:])
    return q, k, v


def _gradient_errors(attention, q, k, v, causal):
    """Largest |ours - reference| of dQ, dK, dV for a random output cotangent, over the reference's
    largest |gradient| (the errors bf16 inputs and outputs allow are ~1% of it)."""
    do = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
    ours = jax.grad(lambda *x: jnp.sum(attention(*x).astype(jnp.float32) * do), argnums=(0, 1, 2))(q, k, v)
    loss = lambda *x: jnp.sum(mha_reference(*x, causal=causal) * do)
    want = jax.grad(loss, argnums=(0, 1, 2))(*(x.astype(jnp.float32) for x in (q, k, v)))
    assert [g.dtype for g in ours] == [jnp.bfloat16] * 3 and [g.shape for g in ours] == [q.shape, k.shape, v.shape]
    return [float(jnp.abs(g.astype(jnp.float32) - w).max() / jnp.abs(w).max()) for g, w in zip(ours, want)]


@interpreted
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


@interpreted
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


@interpreted
@pytest.mark.parametrize(
    "b,t,s,h,kh,d,causal",
    [
        (1, 256, 128, 2, 1, 128, True),  # T > S: the first 128 queries see no key (log-sum-exp +inf)
        (2, 128, 128, 2, 2, 64, False),
    ],
)
def test_interpreted_gradients_match_reference(b, t, s, h, kh, d, causal):
    q, k, v = _inputs(b, t, s, h, kh, d, seed=1)
    errors = _gradient_errors(lambda *x: dot_product_attention(*x, causal=causal, impl="mosaic"), q, k, v, causal)
    assert max(errors) < 2e-2, errors


@interpreted
def test_no_races_in_the_backward():
    """The race detector over the dQ kernel's K/V ring and the dK/dV kernel's query ring (two query
    heads per K/V head, the ring refilled, causal tiles skipped and released, and a program whose
    second consumer's keys lie past S = 192)."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    q, k, v = _inputs(1, 128, 192, 2, 1, 64, seed=4)
    params = InterpretGPUParams(detect_races=True)
    errors = _gradient_errors(lambda *x: flash_attention_mgpu(*x, causal=True, interpret=params), q, k, v, True)
    assert max(errors) < 2e-2, errors
    assert not get_races().races_found


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_lowers_for_cuda(d, causal):
    """The compiled path (wgmma from transposed shared memory and from registers, accumulators
    initialised from registers, WGMMA layouts) lowers at a training shape, GQA 2: one Mosaic GPU
    kernel forward, three for a gradient (forward, dQ, dK/dV)."""
    q = jax.ShapeDtypeStruct((2, 2048, 16, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 2048, 8, d), jnp.bfloat16)
    attention = lambda q, k, v: flash_attention_mgpu(q, k, v, causal=causal, interpret=False)
    loss = lambda *x: attention(*x).astype(jnp.float32).sum()
    for fn, kernels in ((attention, 1), (jax.grad(loss, argnums=(0, 1, 2)), 3)):
        text = jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == kernels


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("causal", [True, False])
def test_compiled_matches_reference_on_gpu(causal):
    """On the GPU (gpu_check's kernel step): the compiled kernels, forward and gradients."""
    q, k, v = _inputs(2, 1024, 1024, 8, 2, 128, seed=5)
    attention = lambda *x: flash_attention_mgpu(*x, causal=causal, interpret=False)
    want = mha_reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal=causal)
    assert float(jnp.abs(attention(q, k, v).astype(jnp.float32) - want).max()) < 2e-2
    errors = _gradient_errors(attention, q, k, v, causal)
    assert max(errors) < 2e-2, errors


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
