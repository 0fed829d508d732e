"""On 8 virtual CPU devices: the engine with weights (dense, then int4) and KV pools split over 8
(tensor) equals one device, with the XLA paged attention and with our Pallas kernels run per device."""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxinfra  # noqa: E402
from jaxinfra.config import ModelConfig  # noqa: E402
from jaxinfra.models import LlamaModel  # noqa: E402
from jaxinfra.quant.quantize import QuantizeConfig, quantize_model  # noqa: E402
from serve import EngineArgs, LLMEngine, SamplingParams  # noqa: E402

cfg = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
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
            k = eng.core.runner.caches[0].k
            assert len(k.sharding.device_set) == 8 and k.addressable_shards[0].data.shape[2] == 1, k.sharding
            flat = dict(nnx.to_flat_state(eng.core.runner.state))
            weight = next(v[...] for p, v in flat.items() if p[-1] == "up_proj" or p[-2:] == ("up_proj", "qweight"))
        outs[tp] = [done[f"r{i}"] for i in range(len(prompts))]
    ref = jaxinfra.generate(model, prompts, jaxinfra.GenerationConfig(max_new_tokens=12, stop_at_eos=False))
    assert outs[1] == outs[8] == ref, (outs, ref)
    return weight


dense = serve_and_compare(LlamaModel(cfg, nnx.Rngs(0)))
assert dense.addressable_shards[0].data.shape == (64, 16), dense.sharding  # MLP columns split 8 ways
quantized = LlamaModel(cfg, nnx.Rngs(0))
quantize_model(quantized, None, QuantizeConfig(method="rtn", bits=4, group_size=32, symmetric=False))
packed = serve_and_compare(quantized)  # int4 weights shard like the dense ones: [K/2, N] over N
assert packed.dtype == np.uint8 and packed.addressable_shards[0].data.shape == (32, 16), packed.sharding
serve_and_compare(LlamaModel(cfg, nnx.Rngs(0)), "pallas")  # our paged kernels (interpreted) per device
print("TP_OK")
