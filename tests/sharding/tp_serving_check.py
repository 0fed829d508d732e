"""On 8 virtual CPU devices: the engine with weights and KV pools split over 8 (tensor) equals one device."""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxinfra  # noqa: E402
from jaxinfra.config import ModelConfig  # noqa: E402
from jaxinfra.models import LlamaModel  # noqa: E402
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
model = LlamaModel(cfg, nnx.Rngs(0))
prompts = [np.random.default_rng(i).integers(0, 512, n).tolist() for i, n in enumerate((5, 23, 9, 14))]
outs = {}
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
    outs[tp] = [done[f"r{i}"] for i in range(len(prompts))]
ref = jaxinfra.generate(model, prompts, jaxinfra.GenerationConfig(max_new_tokens=12, stop_at_eos=False))
assert outs[1] == outs[8] == ref, (outs, ref)
print("TP_OK")
