"""Weight-sync time against the time to copy the same bytes host-to-device, in one process: how long
`LLM.update_weights` takes to put a training state's parameters into a built engine (cast, placed,
prefix cache dropped), next to one `jax.device_put` of those bytes from host memory.

python -m benchmarks.weight_sync                      (the embedded model and llama-3.2-1b, random weights)
python -m benchmarks.weight_sync --models default
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

import jaxinfra
from benchmarks.common import time_fn
from jaxinfra.loading import DEFAULT_MODEL
from serve import LLM


def host_params(model: nnx.Module) -> dict:
    """The model's parameters as host numpy arrays in the trainer's layout (decoder layers stacked
    [L, ...], as TrainState.params with scan_layers): what an RL trainer hands over after an update."""
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    layers = [params["layers"][i] for i in range(len(params["layers"]))]
    return {**params, "layers": jax.tree.map(lambda *xs: np.stack(xs), *layers)}


def measure(name: str, path: str) -> dict[str, float]:
    """Seconds for update_weights and for a device_put of the same bytes (best of a few)."""
    llm = LLM(path, max_model_len=256, max_num_seqs=4, compilation_cache_dir="")
    params = host_params(jaxinfra.load_model(path, seed=1))
    nbytes = sum(a.nbytes for a in jax.tree.leaves(params))
    sync = time_fn(lambda: llm.update_weights(params) or jax.block_until_ready(llm.engine.core.runner.weights), iters=7)
    copy = time_fn(lambda: jax.block_until_ready(jax.device_put(params)), iters=7)
    row = {"bytes": nbytes, "sync_s": sync, "copy_s": copy, "ratio": sync / copy}
    mib = nbytes / 2**20
    print(f"{name:<14} {mib:>9.1f} MiB  sync {sync * 1e3:>8.1f} ms  copy {copy * 1e3:>8.1f} ms  {sync / copy:.2f}x")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="default,llama-3.2-1b", help="comma-separated: default or preset names")
    args = p.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; update_weights vs device_put of the same bytes")
    start = time.perf_counter()
    for name in args.models.split(","):
        measure(name, str(DEFAULT_MODEL) if name == "default" else name)
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
