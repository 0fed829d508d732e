"""On 8 virtual CPU devices (a subprocess of test_context_parallel_serve.py): `LLM` with each step's
tokens split over 4 and 8 devices (context parallelism; also 2 tensor x 4 context, and the XLA paged
attention) gives one device's greedy tokens, for prompts of several prefill chunks and a prompt whose
prefix is cached; the compiled prefill step holds a slice of the chunk per device and gathers K/V."""

import json
import re

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from serve import LLM, SamplingParams  # noqa: E402

ENGINE = dict(
    block_size=8,
    max_model_len=256,
    max_num_seqs=4,
    max_num_batched_tokens=32,  # the 100-token prompt prefills in 4 chunks
    num_gpu_blocks_override=96,
)
rng = np.random.default_rng(0)
PROMPTS = [rng.integers(0, 256, n).tolist() for n in (100, 45, 7)]
SHARED = PROMPTS[0][:64] + rng.integers(0, 256, 30).tolist()  # 64 tokens (8 blocks) cached by then
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def serve(**args: object) -> dict:
    """Greedy tokens of the first batch, then of the prompt with the cached prefix; and its LLM."""
    llm = LLM("tiny-qwen3", **ENGINE, **args)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    (again,) = llm.generate([SHARED], GREEDY, use_tqdm=False)
    return {"tokens": first + [again.outputs[0].token_ids], "cached": again.num_cached_tokens, "llm": llm}


def sharded_prefill(llm: LLM, parts: int) -> dict:
    """What the compiled step of a 32-token prompt chunk holds per device: its layer activations
    (1 x 32/parts tokens x hidden 64), K/V gathered over the chunk, and the KV pools replicated."""
    runner = llm.engine.core.runner
    width = runner.layout.width_buckets[0]
    hlo = runner.compiled_text(runner.dummy(32, runner.layout.mixed_seq_buckets[0], width, 32))
    k = runner.kv_cache.k
    return {
        "activation_slice": f"f32[1,{32 // parts},64]" in hlo,
        "kv_gathers": len(re.findall(r"all-gather(?:-start)?\(", hlo)),
        "pool_devices": len(k.sharding.device_set),
        "pool_replicated": k.addressable_shards[0].data.shape == k.shape,
    }


one = serve()
report: dict = {"one": {"tokens": one["tokens"], "cached": one["cached"]}}
for name, args, parts in (
    ("cp4", dict(context_parallel_size=4), 4),
    ("cp8", dict(context_parallel_size=8), 8),
    ("tp2_cp4", dict(tensor_parallel_size=2, context_parallel_size=4), 4),
):
    run = serve(**args)
    report[name] = {"tokens": run["tokens"], "cached": run["cached"], **sharded_prefill(run["llm"], parts)}
print("CPREPORT" + json.dumps(report))
