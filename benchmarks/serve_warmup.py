"""Serving start-up (engine core built and every step shape compiled, persistent compilation cache
off) against depth: a narrow Llama (hidden 64, so compiling is what start-up costs), each depth in a
fresh process. Rows with the layers scanned (the serving default) and as an unrolled Python loop.

    python -m benchmarks.serve_warmup [--layers 2 32] [--num-scheduler-steps 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

_MEASURE = """
import json, sys, time
t0 = time.perf_counter()
from benchmarks.serve_warmup import measure
print(json.dumps(measure(int(sys.argv[1]), sys.argv[2] == "loop", int(sys.argv[3]), t0)))
"""


def measure(layers: int, loop: bool, num_scheduler_steps: int, t0: float) -> dict:
    """Build an engine core on a narrow random model and warm it up; seconds and step shapes."""
    from flax import nnx

    import serve.core.runner.model_runner
    from jaxinfra.models import LlamaModel
    from jaxinfra.train.compile_cost import narrow_config
    from serve.config import EngineArgs
    from serve.core.engine_core import EngineCore

    if loop:  # the unrolled stack serving ran before its layers were scanned
        serve.core.runner.model_runner.layer_graph = _refuse
    model = LlamaModel(narrow_config(layers), nnx.Rngs(0))
    start = time.perf_counter()
    args = EngineArgs(
        block_size=16,
        max_model_len=256,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        num_gpu_blocks_override=64,
        num_scheduler_steps=num_scheduler_steps,
        compilation_cache_dir="",
    )
    core = EngineCore(model, args)
    core.runner.warmup()
    return dict(
        layers=layers,
        scanned=core.runner.layer_graph is not None,
        warmup_s=time.perf_counter() - start,
        shapes=core.runner.num_compilations,
        process_s=time.perf_counter() - t0,
    )


def _refuse(layers: object) -> tuple:
    raise ValueError("unrolled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--num-scheduler-steps", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=["scan", "loop"], choices=["scan", "loop"])
    args = parser.parse_args()
    rows = []
    for mode in args.modes:
        for layers in args.layers:
            t0 = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-c", _MEASURE, str(layers), mode, str(args.num_scheduler_steps)],
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{mode} {layers} layers: {rows[-1]} ({time.perf_counter() - t0:.1f} s with imports)", flush=True)
    print("\n| layers | layers as | step shapes | start-up with warm-up, s | vs fewest layers |")
    print("|---|---|---|---|---|")
    for mode in args.modes:
        mine = [r for r in rows if r["scanned"] == (mode == "scan")]
        for r in mine:
            print(
                f"| {r['layers']} | {mode} | {r['shapes']} | {r['warmup_s']:.1f} | "
                f"{r['warmup_s'] / mine[0]['warmup_s']:.2f}x |"
            )


if __name__ == "__main__":
    main()
