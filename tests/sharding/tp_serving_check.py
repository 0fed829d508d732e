"""On 8 virtual CPU devices: the engine with weights (dense, then int4) and KV pools split over 8
(tensor) equals one device, with the XLA paged attention and with our Pallas kernels run per device."""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxinfra  # noqa: E402
from jaxinfra.config import ModelConfig  # noqa: E402
from jaxinfra.models import LlamaModel  # noqa: E402
from jaxinfra.quant import qlinear  # noqa: E402
from jaxinfra.quant.quantize import QuantizeConfig, quantize_model  # noqa: E402
from jaxinfra.quant.rtn import QuantScheme, rtn, to_linear  # noqa: E402
from serve import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from sharding import get_rules, logical_rules, shard_state, tensor_parallel_mesh  # noqa: E402

cfg = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=256,  # down_proj: 32 rows of K per device = one int4 group (split per device)
    num_layers=2,
    num_heads=16,
    num_kv_heads=8,
    head_dim=8,
    initializer_range=0.1,
)
prompts = [np.random.default_rng(i).integers(0, 512, n).tolist() for i, n in enumerate((5, 23, 9, 14))]


def serve_and_compare(model: LlamaModel, attn_impl: str | None = None) -> jax.Array:
    """Greedy tokens of the engine on 1 and 8 devices equal the dense reference; returns a 8-way weight."""
    outs = {}
    weight = None
    for tp in (1, 8):
        eng = LLMEngine(
            model,
            None,
            EngineArgs(
                block_size=8,
                max_model_len=128,
                max_num_seqs=4,
                max_num_batched_tokens=16,
                num_gpu_blocks_override=48,
                tensor_parallel_size=tp,
                attn_impl=attn_impl,
            ),
        )
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        if tp > 1:
            k = eng.core.runner.kv_cache.k
            assert len(k.sharding.device_set) == 8 and k.addressable_shards[0].data.shape[3] == 1, k.sharding
            flat = dict(nnx.to_flat_state(eng.core.runner.state))
            weight = next(v[...] for p, v in flat.items() if p[-1] == "up_proj" or p[-2:] == ("up_proj", "qweight"))
        outs[tp] = [done[f"r{i}"] for i in range(len(prompts))]
    ref = jaxinfra.generate(model, prompts, jaxinfra.GenerationConfig(max_new_tokens=12, stop_at_eos=False))
    assert outs[1] == outs[8] == ref, (outs, ref)
    return weight


def quantized_matmuls_split_per_device() -> None:
    """int4 (g32, zero points) and W8A8 linears, column- and row-parallel over 8 devices, equal one
    device; each runs per device (row-parallel: partial products summed across devices)."""
    calls = []
    real = qlinear.per_device
    qlinear.per_device = lambda *a, **k: calls.append(1) or real(*a, **k)
    mesh, rules = tensor_parallel_mesh(8, 8), get_rules("tp")
    w = jax.random.normal(jax.random.key(0), (256, 64), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (5, 256), jnp.float32)
    for scheme in (QuantScheme(4, 32, symmetric=False), QuantScheme(8, None, act_bits=8)):
        for axes in (("mlp", "embed"), ("embed", "mlp")):
            weight = w if axes[0] == "mlp" else w.T.reshape(64, 256)
            inputs = x if axes[0] == "mlp" else x[:, :64]
            q, scale, zero = rtn(weight, scheme)
            layer = to_linear(
                q,
                scale,
                zero,
                scheme,
                in_shape=weight.shape[:1],
                out_shape=weight.shape[1:],
                dtype=jnp.float32,
                axes=axes,
            )
            expected = layer(inputs)
            sharded = nnx.merge(*nnx.split(layer)[:1], shard_state(nnx.state(layer), mesh, rules.params))
            calls.clear()
            with logical_rules(mesh, rules.activations):
                got = jax.jit(lambda m, v: m(v))(sharded, inputs)
            assert calls == [1], (scheme, axes)  # the per-device path, not XLA's partitioning
            np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    qlinear.per_device = real


quantized_matmuls_split_per_device()
dense = serve_and_compare(LlamaModel(cfg, nnx.Rngs(0)))
assert dense.addressable_shards[0].data.shape == (64, 32), dense.sharding  # MLP columns split 8 ways
quantized = LlamaModel(cfg, nnx.Rngs(0))
quantize_model(quantized, None, QuantizeConfig(method="rtn", bits=4, group_size=32, symmetric=False))
packed = serve_and_compare(quantized)  # int4 weights shard like the dense ones: [K/2, N] over N
assert packed.dtype == np.uint8 and packed.addressable_shards[0].data.shape == (32, 32), packed.sharding
serve_and_compare(LlamaModel(cfg, nnx.Rngs(0)), "pallas")  # our paged kernels (interpreted) per device
# the KV pool is sized per device: kv_cache_memory bytes on each device, which holds 1/8 of the heads
args = EngineArgs(block_size=8, max_model_len=128, max_num_seqs=4, kv_cache_memory=2**20, tensor_parallel_size=8)
core = LLMEngine(LlamaModel(cfg, nnx.Rngs(0)), None, args).core
per_device = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(core.runner.kv_cache))
assert 2**20 - per_device // core.block_manager.num_blocks < per_device <= 2**20, per_device
print("TP_OK")
