"""The engine core's own host time per step at 32, 256 and 1024 running decodes (async scheduling,
single steps: how streams are served), measured two ways in one process:

- real: the whole step minus the time spent waiting for the device (tiny-llama on this machine);
- no-op device: the jitted step replaced by one that returns zeros of the same output shapes (the
  KV pool passed through), so what remains is the host's alone.

Each is also taken as the main thread's CPU time per step (`time.thread_time`), which other
processes on a shared machine disturb far less than wall time. Steps run in 5 consecutive runs; the
figure is the lowest of their medians.

    python -m benchmarks.host_overhead [--running 32 256 1024] [--steps 100]
"""

from __future__ import annotations

import argparse
import functools
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfra
from serve import EngineArgs, LLMEngine, SamplingParams
from serve.core.runner import ModelRunner

MODEL = "tiny-llama"


def no_op_step(runner: ModelRunner):
    """A jitted step with the real one's output shapes and no work (the KV pool passed through)."""
    real = runner._step

    def fake(weights, kv, buffers, prev, *, layout, max_q_len):
        shapes = jax.eval_shape(functools.partial(real, layout=layout, max_q_len=max_q_len), weights, kv, buffers, prev)
        zeros = functools.partial(jax.tree.map, lambda s: jnp.zeros(s.shape, s.dtype))
        return tuple(kv if isinstance(s, type(kv)) else zeros(s) for s in shapes)

    return jax.jit(fake, donate_argnums=(1,), static_argnames=("layout", "max_q_len"))


def measure(model, tokenizer, running: int, steps: int, no_op: bool) -> dict:
    eng = LLMEngine(
        model,
        tokenizer,
        EngineArgs(
            model=MODEL,
            block_size=16,
            max_model_len=512,
            max_num_seqs=running,
            max_num_batched_tokens=max(2048, running),
            num_gpu_blocks_override=running * 16,  # room for 16 + 200 tokens each: no preemption
            compilation_cache_dir="",
        ),
    )
    core = eng.core
    if no_op:
        core.runner._step = no_op_step(core.runner)
    rng = np.random.default_rng(2)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=100_000, ignore_eos=True, output_kind="delta")
    for i in range(running):
        eng.add_request(f"h{i}", rng.integers(0, 256, 16).tolist(), params)
    while core.scheduler.waiting or any(s.num_computed_tokens < s.prompt_len for s in core.scheduler.running):
        core.step()
    for _ in range(3):  # the decode shape compiles here
        core.step()
    gc.collect()
    gc.freeze()  # as the core process does once it is up (serve/core/core_proc.py)
    host, cpu = [], []
    for _ in range(steps):
        t0 = time.thread_time()
        core.step()
        cpu.append(time.thread_time() - t0)
        host.append(core.step_time - core.step_wait)
    assert core.stats().num_running == running
    gc.unfreeze()

    def quietest(times: list[float]) -> float:
        """The lowest median of 5 consecutive runs of steps: the host's own time, less what other
        processes on a shared machine add in bursts."""
        return 1e3 * float(min(np.median(block) for block in np.array_split(np.array(times), 5)))

    return {"running": running, "no_op": no_op, "host_ms": quietest(host), "cpu_ms": quietest(cpu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    model, tokenizer = jaxinfra.load_model(MODEL), jaxinfra.load_tokenizer(MODEL)
    rows = []
    for running in args.running:
        for no_op in (True, False):
            rows.append(measure(model, tokenizer, running, args.steps, no_op))
            print(rows[-1], flush=True)
    print(
        "\n| running decodes | host ms/step, no-op device | us/sequence | host CPU ms/step, no-op device | us/sequence "
        "| host ms/step, real step | us/sequence | host CPU ms/step, real step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for running in args.running:
        fake, real = (next(r for r in rows if r["running"] == running and r["no_op"] == x) for x in (True, False))
        print(
            f"| {running} | {fake['host_ms']:.2f} | {1e3 * fake['host_ms'] / running:.1f} | "
            f"{fake['cpu_ms']:.2f} | {1e3 * fake['cpu_ms'] / running:.1f} | "
            f"{real['host_ms']:.2f} | {1e3 * real['host_ms'] / running:.1f} | {real['cpu_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
