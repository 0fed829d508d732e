"""Multi-LoRA benchmark: BGMV (decode batches) and SGMV (a prefill chunk) against the XLA path and
against the base projection they ride on (x @ W, the cost the adapter delta adds to).

GPU:   python -m benchmarks.lora_kernels --out benchmarks/out
CPU smoke (interpret mode, tiny shapes): python -m benchmarks.lora_kernels --quick
Adapters: `slots` slots of rank `rank` (bf16), tokens spread over them round-robin (decode) or in
equal segments (prefill); times are device seconds (calls chained in one jitted loop). The figure
that matters is lora / base: how much a LoRA projection costs over the plain one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.budget import Recorder, add_budget_args
from benchmarks.common import device_seconds
from pallas_kernels.lora_bgmv import bgmv_pallas
from pallas_kernels.lora_reference import lora_delta_reference, segment_slots
from pallas_kernels.lora_sgmv import sgmv_pallas
from pallas_kernels.lora_xla import lora_delta_xla

# (tokens, segments: 0 for decode, in, out, slots, rank): Llama-8B's q and MLP down projections
GPU_SHAPES = [
    *((t, 0, 4096, 4096, 8, 16) for t in (1, 16, 64, 256)),
    (256, 0, 14336, 4096, 8, 16),
    (256, 0, 4096, 4096, 32, 64),
    (2048, 4, 4096, 4096, 8, 16),
    (2048, 16, 14336, 4096, 32, 64),
]
QUICK_SHAPES = [(8, 0, 40, 72, 4, 8), (40, 3, 40, 72, 4, 8)]


def run(
    shapes: list[tuple[int, int, int, int, int, int]], interpret: bool, out: Path | None, rec: Recorder | None = None
) -> list[dict]:
    """One row per shape, handed to `rec` and saved as measured; no new row past the budget."""
    rec = rec or Recorder()
    for t, segs, k, n, s, r in shapes:
        if not rec.more():
            break
        kx, ka, kb, kw = jax.random.split(jax.random.key(0), 4)
        x = jax.random.normal(kx, (t, k), jnp.bfloat16)
        a = jax.random.normal(ka, (s, k, r), jnp.bfloat16) * k**-0.5
        b = jax.random.normal(kb, (s, r, n), jnp.bfloat16) * r**-0.5
        w = jax.random.normal(kw, (k, n), jnp.bfloat16) * k**-0.5
        scaling = jnp.full((s,), 2.0, jnp.float32)
        if segs:
            starts = jnp.asarray(np.linspace(0, t, segs + 1).astype(np.int32))
            seg_slots = jnp.arange(segs, dtype=jnp.int32) % s
            slots = segment_slots(starts, seg_slots, t)
            kernel = lambda x, a, b, sc: sgmv_pallas(x, starts, seg_slots, a, b, sc, interpret=interpret)
        else:
            slots = jnp.arange(t, dtype=jnp.int32) % s
            kernel = lambda x, a, b, sc: bgmv_pallas(x, slots, a, b, sc, interpret=interpret)
        impls = {"pallas": kernel, "xla": lambda x, a, b, sc: lora_delta_xla(x, slots, a, b, sc)}
        want = np.asarray(lora_delta_reference(x, slots, a, b, scaling), np.float32)
        row: dict = {"T": t, "segments": segs, "K": k, "N": n, "slots": s, "rank": r}
        iters = 3 if interpret else 20
        row["base_us"] = device_seconds(lambda x, w: x @ w, x, w, iters=iters) * 1e6
        for name, fn in impls.items():
            got = np.asarray(jax.jit(fn)(x, a, b, scaling), np.float32)
            row[f"{name}_rel_err"] = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-9))
            row[f"{name}_us"] = device_seconds(fn, x, a, b, scaling, iters=iters) * 1e6
        rec.add(row)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "lora_kernels.json").write_text(json.dumps(rec.rows, indent=2))
        kind = f"sgmv {segs} segments" if segs else "bgmv"
        ratio = {name: row[f"{name}_us"] / row["base_us"] for name in impls}
        print(
            f"{kind} T{t} K{k} N{n} S{s} R{r}: pallas {row['pallas_us']:.0f} us, xla {row['xla_us']:.0f} us "
            f"({row['xla_us'] / row['pallas_us']:.2f}x), base matmul {row['base_us']:.0f} us "
            f"(delta / base: pallas {ratio['pallas']:.2f}, xla {ratio['xla']:.2f}); "
            f"rel err pallas {row['pallas_rel_err']:.1e}, xla {row['xla_rel_err']:.1e}",
            flush=True,
        )
    return rec.rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, interpret mode (CPU smoke test)")
    parser.add_argument("--out", type=Path, default=None)
    add_budget_args(parser, "lora_kernels")
    args = parser.parse_args()
    interpret = args.quick or jax.default_backend() != "gpu"
    print("multi-LoRA: BGMV / SGMV (ours) vs the XLA path vs the base projection")
    run(QUICK_SHAPES if args.quick else GPU_SHAPES, interpret, args.out, Recorder.from_args(args))


if __name__ == "__main__":
    main()
