"""Multi-LoRA kernels (BGMV, SGMV in interpret mode) and the XLA path against the jnp reference,
and the reference against a float64 numpy oracle that multiplies each adapter at its own rank:
odd dims, T = 1 / 7 / 33, ranks 1, 8, 16 padded to 16, rows without an adapter, one slot for
every row, a different slot per row, float32 and bfloat16, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    BgmvTiles,
    SgmvTiles,
    bgmv_pallas,
    lora_apply,
    lora_delta_reference,
    lora_delta_xla,
    segment_slots,
    sgmv_pallas,
)
from tests.kernels.tolerances import f32_atol

RANKS = (1, 8, 16, 16, 8, 1, 16, 8)  # one adapter per slot, padded to max rank 16
IN, OUT = 40, 136  # neither a multiple of 128


def pools(dtype, n_in=IN, n_out=OUT, seed=0):
    """Random adapter pools, each slot zero past its rank."""
    ka, kb, ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    live = (np.arange(16)[None, :] < np.asarray(RANKS)[:, None]).astype(np.float32)
    a = jax.random.normal(ka, (len(RANKS), n_in, 16)) * live[:, None, :]
    b = jax.random.normal(kb, (len(RANKS), 16, n_out)) * live[:, :, None]
    scaling = jax.random.uniform(ks, (len(RANKS),), minval=0.5, maxval=2.0)
    return a.astype(dtype), b.astype(dtype), scaling


def segments(slots):
    """Run-length segments of a slot list, as SGMV takes them."""
    starts = [0] + [t for t in range(1, len(slots)) if slots[t] != slots[t - 1]]
    return jnp.asarray(starts + [len(slots)], jnp.int32), jnp.asarray([slots[t] for t in starts], jnp.int32)


def numpy_oracle(x, slots, a, b, scaling):
    x, a, b, scaling = (np.asarray(v, np.float64) for v in (x, a, b, scaling))
    out = np.zeros((x.shape[0], b.shape[2]))
    for t, s in enumerate(slots):
        if s >= 0:
            r = RANKS[s]
            out[t] = scaling[s] * (x[t] @ a[s, :, :r]) @ b[s, :r]
    return out


CASES = {  # name: (tokens' slots, dtype, BGMV tiles, SGMV tiles)
    "one token": ([3], jnp.float32, None, None),
    "every row its own slot": ([7, 0, 5, 2, 6, 1, 4], jnp.float32, BgmvTiles(16, 32, 2), SgmvTiles(16, 16, 32)),
    "mixed, some without": ([0] * 5 + [-1] * 9 + [2] * 3 + [5] * 10 + [-1, 1, 1, 4, 4, 4], jnp.bfloat16, None, None),
    "all one slot": ([6] * 33, jnp.float32, None, SgmvTiles(16, 16, 16)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_and_xla_match_reference(name):
    slot_list, dtype, bgmv_tiles, sgmv_tiles = CASES[name]
    a, b, scaling = pools(dtype)
    x = jax.random.normal(jax.random.PRNGKey(len(slot_list)), (len(slot_list), IN)).astype(dtype)
    slots = jnp.asarray(slot_list, jnp.int32)
    want = lora_delta_reference(x, slots, a, b, scaling)
    oracle = numpy_oracle(x, slot_list, a, b, scaling)
    f32 = dtype == jnp.float32
    atol, rtol = (f32_atol(1e-4), 1e-5) if f32 else (0.25, 0.02)  # bf16: outputs reach ~30
    np.testing.assert_allclose(np.asarray(want, np.float64), oracle, atol=1e-4 if f32 else 0.25, rtol=rtol)
    assert np.abs(oracle).max() > 1.0 and not oracle[np.asarray(slot_list) < 0].any()
    starts, seg_slots = segments(slot_list)
    got = {
        "bgmv": bgmv_pallas(x, slots, a, b, scaling, tiles=bgmv_tiles, interpret=True),
        "sgmv": sgmv_pallas(x, starts, seg_slots, a, b, scaling, tiles=sgmv_tiles, interpret=True),
        "xla": lora_delta_xla(x, slots, a, b, scaling),
        "dispatch": lora_apply(x, a, b, scaling, seg_starts=starts, seg_slots=seg_slots),
    }
    for impl, out in got.items():
        assert out.dtype == dtype and out.shape == (len(slot_list), OUT), impl
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(want, np.float32), atol=atol, rtol=rtol, err_msg=impl
        )


def test_gradients_match_reference():
    slot_list = [2, -1, 2, 5, 0, 0, 7]
    a, b, scaling = pools(jnp.float32, seed=1)
    x = jax.random.normal(jax.random.PRNGKey(2), (len(slot_list), IN))
    dy = jax.random.normal(jax.random.PRNGKey(3), (len(slot_list), OUT))
    slots = jnp.asarray(slot_list, jnp.int32)
    starts, seg_slots = segments(slot_list)
    impls = {
        "bgmv": lambda x, a, b, sc: bgmv_pallas(x, slots, a, b, sc, interpret=True),
        "sgmv": lambda x, a, b, sc: sgmv_pallas(x, starts, seg_slots, a, b, sc, interpret=True),
    }
    _, ref_vjp = jax.vjp(lambda *p: lora_delta_reference(p[0], slots, *p[1:]), x, a, b, scaling)
    want = ref_vjp(dy)
    for impl, fn in impls.items():
        _, vjp = jax.vjp(fn, x, a, b, scaling)
        for name, g, w in zip(("x", "A", "B", "scaling"), vjp(dy), want):
            assert np.abs(np.asarray(w)).max() > 0.1, name
            np.testing.assert_allclose(
                np.asarray(g), np.asarray(w), atol=f32_atol(1e-3), rtol=1e-4, err_msg=impl + name
            )


def test_segment_slots_and_tokens_past_the_segments():
    starts, seg_slots = jnp.asarray([2, 4, 4, 7], jnp.int32), jnp.asarray([3, 1, -1], jnp.int32)
    np.testing.assert_array_equal(np.asarray(segment_slots(starts, seg_slots, 9)), [-1, -1, 3, 3, -1, -1, -1, -1, -1])
    a, b, scaling = pools(jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(4), (9, IN))
    out = np.asarray(sgmv_pallas(x, starts, seg_slots, a, b, scaling, tiles=SgmvTiles(16, 16, 16), interpret=True))
    assert not out[[0, 1, 4, 5, 6, 7, 8]].any() and np.abs(out[2:4]).min() > 0


def test_bad_input_names_the_argument():
    a, b, scaling = pools(jnp.float32)
    x, slots = jnp.ones((3, IN)), jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match="A must be"):
        bgmv_pallas(jnp.ones((3, IN + 1)), slots, a, b, scaling)
    with pytest.raises(ValueError, match="B must be"):
        lora_delta_xla(x, slots, a, b[:, :8], scaling)
    with pytest.raises(ValueError, match="scaling must be"):
        lora_delta_reference(x, slots, a, b, scaling[:2])
    with pytest.raises(ValueError, match="slots must be"):
        lora_apply(x, a, b, scaling, slots=slots[:2])
    with pytest.raises(ValueError, match="seg_starts"):
        sgmv_pallas(x, jnp.asarray([0, 3]), jnp.asarray([0, 1]), a, b, scaling)
    with pytest.raises(ValueError, match="either slots or both"):
        lora_apply(x, a, b, scaling)
    with pytest.raises(ValueError, match="lora impl"):
        lora_apply(x, a, b, scaling, slots=slots, impl="cuda")
