"""Collective bandwidth over all devices, like nccl-tests: all-reduce, all-gather, reduce-scatter,
all-to-all and ppermute (a ring shift), at message sizes from 1 KB up.

GPU:   python -m benchmarks.collectives --out benchmarks/out
CPU:   python -m benchmarks.collectives --cpu-devices 8 [--quick]
Size is the per-device buffer (all-gather: the gathered output; reduce-scatter: the input). algbw =
size / time; busbw = algbw x the nccl-tests factor (all-reduce 2(n-1)/n; all-gather, reduce-scatter
and all-to-all (n-1)/n; ppermute 1), so busbw compares with the link's bandwidth whatever n is.
Times are device times (calls chained in one jitted loop). With one device there is no traffic: the
rows then only say what the collective costs in launches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.budget import Recorder, add_budget_args

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute")


def bus_factor(op: str, n: int) -> float:
    if n == 1:
        return 1.0
    return {"all_reduce": 2 * (n - 1) / n, "ppermute": 1.0}.get(op, (n - 1) / n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-devices", type=int, default=None, help="virtual CPU devices (set before jax starts)")
    parser.add_argument("--quick", action="store_true", help="sizes up to 1 MB")
    parser.add_argument("--max-bytes", type=int, default=2**30)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    add_budget_args(parser, "collectives")
    args = parser.parse_args()
    rec = Recorder.from_args(args)
    if args.cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax

        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from tqdm.auto import tqdm

    from benchmarks.common import device_seconds

    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(devices, ("d",))
    spec = PartitionSpec("d")
    ring = [(i, (i + 1) % n) for i in range(n)]
    bodies = {
        "all_reduce": lambda x: jax.lax.psum(x, "d"),
        "all_gather": lambda x: jax.lax.all_gather(x, "d", tiled=True),
        "reduce_scatter": lambda x: jax.lax.psum_scatter(x, "d", tiled=True),
        "all_to_all": lambda x: jax.lax.all_to_all(x.reshape(n, -1), "d", 0, 0, tiled=True).reshape(-1),
        "ppermute": lambda x: jax.lax.ppermute(x, "d", ring),
    }
    max_bytes = 2**20 if args.quick else args.max_bytes
    sizes = [s for s in (2 ** (10 + 2 * i) for i in range(11)) if s <= max_bytes]
    rows = rec.rows
    for op in OPS:
        fn = jax.jit(jax.shard_map(bodies[op], mesh=mesh, in_specs=spec, out_specs=spec))
        for size in tqdm(sizes, desc=op, unit="size", leave=False):
            if not rec.more():
                break
            elems = max(size // 4, n * n) // (n * n) * (n * n)  # divisible for gather/scatter/all-to-all
            per_device = elems // n if op == "all_gather" else elems  # all-gather: size is the output
            x = jax.device_put(jnp.ones((per_device * n,), jnp.float32), NamedSharding(mesh, spec))
            seconds = device_seconds(fn, x, iters=10)
            algbw = elems * 4 / seconds / 1e9
            rec.add(
                dict(op=op, bytes=elems * 4, devices=n, us=seconds * 1e6, algbw=algbw, busbw=algbw * bus_factor(op, n))
            )
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "collectives.json").write_text(json.dumps(rows, indent=2))
    print(f"\ncollectives over {n} {devices[0].platform} device(s): busbw GB/s (time us)")
    print("| bytes | " + " | ".join(OPS) + " |")
    print("|---" * (len(OPS) + 1) + "|")
    for size in sorted({r["bytes"] for r in rows}):
        cells = []
        for op in OPS:
            r = next((r for r in rows if r["op"] == op and r["bytes"] == size), None)
            cells.append("-" if r is None else f"{r['busbw']:.2f} ({r['us']:.0f})")
        print(f"| {size:,} | " + " | ".join(cells) + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
