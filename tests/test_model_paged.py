"""The model over a paged KV cache (chunked prefill + decode, flat ragged batches) equals dense."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfra
from pallas_kernels import PagedKVCache, PagedMetadata

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

BS = 4


def _step(model, caches, tokens_per_seq, starts, tables):
    """One flat batch: sequence i brings tokens_per_seq[i] new tokens starting at position starts[i]."""
    ids, pos, slots, cu = [], [], [], [0]
    for toks, start, table in zip(tokens_per_seq, starts, tables):
        p = np.arange(start, start + len(toks))
        ids += list(toks)
        pos += list(p)
        slots += [table[i // BS] * BS + i % BS for i in p]
        cu.append(cu[-1] + len(toks))
    pad = 3  # padding tokens: slot -1, position 0
    ids, pos, slots = ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad
    kv_lens = [s + len(t) for s, t in zip(starts, tokens_per_seq)]
    width = max(len(t) for t in tables)
    bt = np.array([list(t) + [0] * (width - len(t)) for t in tables], np.int32)
    meta = PagedMetadata(
        jnp.asarray(slots, jnp.int32), jnp.asarray(bt), jnp.asarray(cu, jnp.int32), jnp.asarray(kv_lens, jnp.int32)
    )
    logits, caches, _ = model.forward(jnp.asarray([ids], jnp.int32), jnp.asarray([pos], jnp.int32), meta, caches)
    return np.asarray(logits[0]), caches


@pytest.mark.parametrize(
    "impl,kv_dtype", [("reference", None), ("pallas", None), ("reference", "int8"), ("pallas", "float8_e4m3fn")]
)
def test_chunked_prefill_and_decode_equal_dense(impl, kv_dtype):
    model = jaxinfra.load_model("tiny-qwen3", attn_impl=impl)
    cfg = model.cfg
    caches = [
        PagedKVCache.zeros(16, BS, cfg.num_kv_heads, cfg.head_dim, kv_dtype or cfg.dtype) for _ in range(cfg.num_layers)
    ]
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 512, 11).tolist(), rng.integers(0, 512, 6).tolist()
    tables = [[9, 2, 14], [5, 0]]  # shuffled, non-contiguous blocks
    dense_a = np.asarray(model(jnp.asarray([a], jnp.int32))[0])
    dense_b = np.asarray(model(jnp.asarray([b], jnp.int32))[0])
    # step 1: A's first chunk (7 tokens) with B's whole prompt but its last token
    out, caches = _step(model, caches, [a[:7], b[:5]], [0, 0], tables)
    tol = {None: 1e-4, "int8": 5e-2, "float8_e4m3fn": 0.2}[kv_dtype]  # e4m3 keeps 3 mantissa bits
    np.testing.assert_allclose(out[:7], dense_a[:7], atol=tol)
    np.testing.assert_allclose(out[7:12], dense_b[:5], atol=tol)
    # step 2: A's second chunk (4 tokens) and B's decode of its last token, in one ragged batch
    out, caches = _step(model, caches, [a[7:], b[5:]], [7, 5], tables)
    np.testing.assert_allclose(out[:4], dense_a[7:], atol=tol)
    np.testing.assert_allclose(out[4], dense_b[5], atol=tol)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_engine_serves_head_dims_that_are_not_powers_of_two(head_dim):
    """Pools hold the true head dim on every path (the Pallas kernel pads in registers only), and
    the engine sizes them so: greedy tokens of the Pallas path equal the reference implementation's."""
    from flax import nnx

    from jaxinfra.config import ModelConfig
    from jaxinfra.models import LlamaModel
    from serve import EngineArgs, LLMEngine, SamplingParams
    from serve.core.runner.sizing import kv_block_bytes

    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    model = LlamaModel(cfg, nnx.Rngs(0))
    outputs = {}
    for impl in ("pallas", "reference"):
        args = EngineArgs(
            block_size=8,
            max_model_len=64,
            max_num_seqs=2,
            max_num_batched_tokens=32,
            num_gpu_blocks_override=16,
            attn_impl=impl,
        )
        eng = LLMEngine(model, None, args)
        pool = eng.core.runner.kv_cache.k
        assert pool.shape[-1] == head_dim
        assert 2 * pool.nbytes == 16 * kv_block_bytes(cfg, 8, "auto")
        for i, prompt in enumerate(([3, 9, 27, 81, 5], [7, 1])):
            eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        done = {}
        while eng.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        outputs[impl] = done
    assert outputs["pallas"] == outputs["reference"]
