"""MoE grouped matmul benchmark: our Pallas kernel against jax.lax.ragged_dot and a dense loop over
experts (each expert's matmul over every row, masked), forward and forward + backward, in one run.

GPU:   python -m benchmarks.grouped_matmul --out benchmarks/out
CPU smoke (interpret mode, tiny shapes): python -m benchmarks.grouped_matmul --quick
Rows are routed to experts with a skew (Zipf-like weights), sorted by expert as the MoE layer does;
times are device seconds (calls chained in one jitted loop); TFLOP/s count only the useful
2 * M * K * N of the ragged product (x3 with the backward).
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
from pallas_kernels.grouped_matmul import grouped_matmul_pallas
from pallas_kernels.grouped_matmul_reference import grouped_matmul_reference

GPU_SHAPES = [(8192, 128, 2048, 768), (8192, 8, 4096, 14336)]  # (M copies, experts, K, N): Qwen3-30B-A3B, Mixtral
QUICK_SHAPES = [(96, 4, 32, 32)]


def dense_loop(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The baseline without ragged support: every expert multiplies every row; rows are kept by mask."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(x.shape[0])[:, None]
    out = jnp.zeros((x.shape[0], w.shape[2]), x.dtype)
    for e in range(w.shape[0]):
        inside = (rows >= ends[e] - group_sizes[e]) & (rows < ends[e])
        out = jnp.where(inside, x @ w[e], out)
    return out


def skewed_sizes(m: int, g: int) -> np.ndarray:
    p = 1.0 / np.arange(1, g + 1) ** 0.7
    counts = np.random.default_rng(0).multinomial(m, p / p.sum())
    return counts.astype(np.int32)


def run(
    shapes: list[tuple[int, int, int, int]], interpret: bool, out: Path | None, rec: Recorder | None = None
) -> list[dict]:
    """One row per shape, handed to `rec` and saved as measured; no new row past the budget."""
    rec = rec or Recorder()
    rows = rec.rows
    impls = {
        "pallas": lambda x, w, gs: grouped_matmul_pallas(x, w, gs, interpret=interpret),
        "ragged_dot": grouped_matmul_reference,
        "dense_loop": dense_loop,
    }
    for m, g, k, n in shapes:
        if not rec.more():
            break
        kx, kw = jax.random.split(jax.random.key(0))
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = jax.random.normal(kw, (g, k, n), jnp.bfloat16) * 0.02
        gs = jnp.asarray(skewed_sizes(m, g))
        want = np.asarray(grouped_matmul_reference(x, w, gs), np.float32)
        row: dict = {"M": m, "G": g, "K": k, "N": n, "max_group": int(gs.max())}
        for name, fn in impls.items():
            err = np.abs(np.asarray(jax.jit(fn)(x, w, gs), np.float32) - want).max() / (np.abs(want).max() + 1e-9)
            row[f"{name}_rel_err"] = float(err)
            train = jax.grad(lambda x, w, gs, fn=fn: fn(x, w, gs).astype(jnp.float32).sum(), (0, 1))
            row[f"{name}_fwd_us"] = device_seconds(fn, x, w, gs, iters=3 if interpret else 20) * 1e6
            row[f"{name}_fwd_bwd_us"] = (
                device_seconds(lambda x, w, gs, t=train: t(x, w, gs)[0], x, w, gs, iters=3 if interpret else 10) * 1e6
            )
        flops = 2 * m * k * n
        row["pallas_fwd_tflops"] = flops / row["pallas_fwd_us"] / 1e6
        rec.add(row)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "grouped_matmul.json").write_text(json.dumps(rows, indent=2))
        print(
            f"M{m} G{g} K{k} N{n}: forward pallas {row['pallas_fwd_us']:.0f} us, ragged_dot "
            f"{row['ragged_dot_fwd_us']:.0f} us ({row['ragged_dot_fwd_us'] / row['pallas_fwd_us']:.2f}x), dense loop "
            f"{row['dense_loop_fwd_us']:.0f} us ({row['dense_loop_fwd_us'] / row['pallas_fwd_us']:.2f}x); fwd+bwd "
            f"pallas {row['pallas_fwd_bwd_us']:.0f} us, ragged_dot {row['ragged_dot_fwd_bwd_us']:.0f} us "
            f"({row['ragged_dot_fwd_bwd_us'] / row['pallas_fwd_bwd_us']:.2f}x), dense loop "
            f"{row['dense_loop_fwd_bwd_us']:.0f} us; pallas {row['pallas_fwd_tflops']:.0f} TFLOP/s forward; "
            f"rel err pallas {row['pallas_rel_err']:.1e}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, interpret mode (CPU smoke test)")
    parser.add_argument("--out", type=Path, default=None)
    add_budget_args(parser, "grouped_matmul")
    args = parser.parse_args()
    interpret = args.quick or jax.default_backend() != "gpu"
    print("grouped matmul (MoE experts): ours vs ragged_dot vs a dense per-expert loop")
    run(QUICK_SHAPES if args.quick else GPU_SHAPES, interpret, args.out, Recorder.from_args(args))


if __name__ == "__main__":
    main()
