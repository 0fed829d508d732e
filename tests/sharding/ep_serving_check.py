"""Run on 8 virtual CPU devices (a subprocess of test_moe_serving.py): the engine serving a tiny MoE
with its 4 experts split over 4 devices (2 tensor-parallel x 2 expert) and on one device. Prints one
JSON report: greedy tokens, per-expert loads, the expert weights' shards."""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxinfra  # noqa: E402
from serve import EngineArgs, LLMEngine, SamplingParams  # noqa: E402

SMALL = dict(block_size=8, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, num_gpu_blocks_override=24)
MODEL = jaxinfra.load_model("tiny-mixtral", dtype="float32")
PROMPTS = [np.random.default_rng(i).integers(0, 512, n).tolist() for i, n in enumerate((5, 23, 9))]


def serve(**parallel: object) -> dict:
    """Greedy tokens of PROMPTS, the expert loads and the expert weights' shard shape."""
    args = EngineArgs(**SMALL, **parallel)  # type: ignore[arg-type]
    eng = LLMEngine(MODEL, None, args)  # the engine places copies of its weights: MODEL is not changed
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    runner = eng.core.runner
    gate = next(v[...] for p, v in nnx.to_flat_state(runner.state) if p[-1] == "expert_gate")
    load = eng.core.stats().expert_load
    return {
        "tokens": [done[f"r{i}"] for i in range(len(PROMPTS))],
        "load": load.tokens if load else None,
        "gate_shard": list(gate.addressable_shards[0].data.shape),
        "devices": len(gate.sharding.device_set),
    }


json.dump(
    {
        "one": serve(),
        "wide": serve(tensor_parallel_size=2, expert_parallel_size=4),
    },
    sys.stdout,
)
