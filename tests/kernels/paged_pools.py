"""Random paged KV pools for the paged-attention kernel tests: shuffled tables, poisoned unowned blocks."""

import jax.numpy as jnp
import numpy as np

from pallas_kernels import quantize
from tests.kernels.tolerances import f32_atol

D = 32
QUANTIZED = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


class Pool:
    """A pool with shuffled, non-contiguous block tables; unowned blocks (and table padding) are
    poisoned with NaN so any read of a block a sequence does not own shows up in its output."""

    def __init__(self, lens, bs, kh, dtype, seed=0, extra_blocks=5, d=D):
        rng = np.random.default_rng(seed)
        pages = [-(-n // bs) for n in lens]
        nb = sum(pages) + extra_blocks
        self.mb = max(max(pages), 1) + 1  # one spare column of table padding
        perm = rng.permutation(nb)
        poison = perm[-1]
        bt = np.full((len(lens), self.mb), poison, np.int32)
        owned = np.zeros(nb, bool)
        c = 0
        for i, p in enumerate(pages):
            bt[i, :p] = perm[c : c + p]
            owned[perm[c : c + p]] = True
            c += p
        self.block_tables = jnp.asarray(bt)
        k = rng.standard_normal((nb, bs, kh, d)).astype(np.float32)
        v = rng.standard_normal((nb, bs, kh, d)).astype(np.float32)
        self.kv_lens = jnp.asarray(lens, jnp.int32)
        if dtype in QUANTIZED:
            (kq, ks), (vq, vs) = (quantize(jnp.asarray(x).reshape(-1, kh, d), QUANTIZED[dtype]) for x in (k, v))
            shape = (nb, bs, kh)
            self.clean = dict(
                k_pool=kq.reshape(k.shape),
                v_pool=vq.reshape(v.shape),
                k_scales=ks.reshape(shape),
                v_scales=vs.reshape(shape),
            )
            bad = ~owned[:, None, None]
            self.poisoned = dict(
                self.clean,
                k_scales=jnp.where(bad, jnp.nan, self.clean["k_scales"]),
                v_scales=jnp.where(bad, jnp.nan, self.clean["v_scales"]),
            )
        else:
            dt = jnp.dtype(dtype)
            self.clean = dict(k_pool=jnp.asarray(k, dt), v_pool=jnp.asarray(v, dt))
            bad = ~owned[:, None, None, None]
            self.poisoned = dict(
                k_pool=jnp.where(bad, jnp.nan, k).astype(dt), v_pool=jnp.where(bad, jnp.nan, v).astype(dt)
            )


def tolerance(dtype):
    return 2e-2 if dtype == "bfloat16" else f32_atol(1e-5)


def query_dtype(dtype):
    return jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
