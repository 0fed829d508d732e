"""Flash attention benchmark: ours (Triton-lowered Pallas; on a GPU also the Mosaic GPU forward) vs XLA,
cuDNN and JAX's shipped Pallas `mha`, forward and fwd+bwd.

Run on a GPU:  python -m benchmarks.attention --out benchmarks/out
Quick CPU smoke (interpret mode, tiny shapes): python -m benchmarks.attention --quick
Prints TFLOP/s (causal counts half the FLOPs), fraction of the measured bf16 matmul peak, the ratio
to cuDNN, and the max error against the float32 reference; writes JSON and a PNG chart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from benchmarks.budget import Recorder, add_budget_args
from benchmarks.common import matmul_peak_tflops, time_fn
from pallas_kernels import BlockSizes, dot_product_attention, flash_attention, mha_reference


@dataclasses.dataclass(frozen=True)
class Shape:
    b: int
    t: int
    h: int
    kh: int
    d: int
    causal: bool

    @property
    def label(self) -> str:
        heads = f"{self.h}" if self.h == self.kh else f"{self.h}/{self.kh}"
        return f"({self.b},{self.t},{heads},{self.d}){' causal' if self.causal else ''}"

    def fwd_flops(self) -> float:
        flops = 4 * self.b * self.h * self.t * self.t * self.d
        return flops / 2 if self.causal else flops


GPU_SHAPES = [
    Shape(8, 2048, 16, 16, 128, True),
    Shape(8, 2048, 16, 16, 128, False),
    Shape(2, 8192, 16, 16, 128, True),
    Shape(2, 8192, 16, 16, 128, False),
    Shape(4, 4096, 32, 8, 128, True),
    Shape(8, 2048, 32, 32, 64, True),
    Shape(8, 2048, 32, 32, 64, False),
]
QUICK_SHAPES = [Shape(1, 64, 4, 2, 32, True), Shape(1, 64, 4, 4, 32, False)]


def _impls(quick: bool) -> dict[str, Callable]:
    """name -> fn(q, k, v, causal) for every implementation available on this backend."""
    interpret = quick or jax.default_backend() != "gpu"
    blocks = BlockSizes(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16) if quick else None

    def ours(q, k, v, causal):
        return flash_attention(q, k, v, causal=causal, block_sizes=blocks, interpret=interpret)

    def shipped_mha(q, k, v, causal):
        from jax.experimental.pallas.ops.gpu.attention import BlockSizes as MhaBlocks
        from jax.experimental.pallas.ops.gpu.attention import mha

        rep = q.shape[2] // k.shape[2]  # shipped mha has no GQA: it needs K/V repeated per query head
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        kwargs = {"block_sizes": MhaBlocks(16, 16, 16, 16, 16, 16)} if quick else {}
        return mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal, interpret=interpret, **kwargs)

    impls: dict[str, Callable] = {"ours": ours}
    if jax.default_backend() == "gpu":  # ours and the bar first: a step's budget may end a shape early
        impls["ours_mosaic"] = lambda q, k, v, causal: dot_product_attention(q, k, v, causal=causal, impl="mosaic")
        impls["cudnn"] = lambda q, k, v, causal: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"
        )
    impls["jax_pallas_mha"] = shipped_mha
    impls["xla"] = lambda q, k, v, causal: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    return impls


def run(shapes: list[Shape], quick: bool, dtype: jnp.dtype, rec: Recorder | None = None) -> tuple[list[dict], float]:
    """One row per shape and implementation, each handed to `rec` as measured; stops at its budget."""
    rec = rec or Recorder()
    peak = matmul_peak_tflops(n=256 if quick else 8192, dtype=dtype)
    rec.note(peak_tflops=peak)
    rows = rec.rows
    for shape in tqdm(shapes, desc="attention shapes"):
        if not rec.more():
            break
        ks = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(ks[0], (shape.b, shape.t, shape.h, shape.d), dtype)
        k = jax.random.normal(ks[1], (shape.b, shape.t, shape.kh, shape.d), dtype)
        v = jax.random.normal(ks[2], (shape.b, shape.t, shape.kh, shape.d), dtype)
        do = jax.random.normal(ks[3], q.shape, dtype)
        ref = mha_reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal=shape.causal)
        for name, fn in _impls(quick).items():
            if not rec.more():
                break
            fwd = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, shape.causal))
            bwd = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v, shape.causal) * do), argnums=(0, 1, 2)))
            timing = dict(warmup=1 if quick else 3, iters=2 if quick else 20)
            try:
                err = float(jnp.abs(fwd(q, k, v).astype(jnp.float32) - ref).max())
                t_fwd = time_fn(fwd, q, k, v, **timing)
            except Exception as e:  # a baseline that cannot run this shape is reported, not fatal
                rec.add({"shape": shape.label, "impl": name, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            flops = shape.fwd_flops()
            row = {"shape": shape.label, "impl": name, "max_err": err, "fwd_ms": t_fwd * 1e3}
            row["fwd_tflops"] = flops / t_fwd / 1e12
            try:  # a baseline whose backward cannot run this shape still gets its forward row
                t_bwd = time_fn(bwd, q, k, v, **timing)
                row |= {"fwdbwd_ms": t_bwd * 1e3, "fwdbwd_tflops": 3.5 * flops / t_bwd / 1e12}
            except Exception as e:
                row["fwdbwd_error"] = f"{type(e).__name__}: {e}"[:200]
            rec.add(row)
    return rows, peak


def print_table(rows: list[dict], peak: float) -> None:
    base = {(r["shape"]): r for r in rows if r["impl"] == "cudnn" and "fwd_ms" in r}
    print(f"\nmeasured matmul peak: {peak:.1f} TFLOP/s   (fwd+bwd FLOPs = 3.5 x fwd)")
    print(
        f"{'shape':<24} {'impl':<15} {'fwd TF/s':>9} {'%peak':>6} {'vs cuDNN':>8} {'f+b TF/s':>9} "
        f"{'vs cuDNN':>8} {'max err':>9}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<24} {r['impl']:<15} n/a: {r['error']}")
            continue
        c = base.get(r["shape"])
        rf = f"{c['fwd_ms'] / r['fwd_ms']:.2f}x" if c else "-"
        both = "fwdbwd_ms" in r
        rb = f"{c['fwdbwd_ms'] / r['fwdbwd_ms']:.2f}x" if c and both else "-"
        fb = f"{r['fwdbwd_tflops']:>9.1f}" if both else f"{'fwd only':>9}"
        print(
            f"{r['shape']:<24} {r['impl']:<15} {r['fwd_tflops']:>9.1f} {100 * r['fwd_tflops'] / peak:>5.0f}% "
            f"{rf:>8} {fb} {rb:>8} {r['max_err']:>9.2e}"
        )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "fwd_ms" in r]
    shapes = list(dict.fromkeys(r["shape"] for r in ok))
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / max(len(impls), 1)
    for ax, key, title in ((axes[0], "fwd_tflops", "forward"), (axes[1], "fwdbwd_tflops", "forward + backward")):
        for j, impl in enumerate(impls):
            vals = [next((r.get(key, 0.0) for r in ok if r["shape"] == s and r["impl"] == impl), 0.0) for s in shapes]
            ax.bar([i + j * width for i in range(len(shapes))], vals, width, label=impl)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], shapes, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"attention {title}")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, interpret mode (CPU smoke run)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    add_budget_args(parser, "attention")
    args = parser.parse_args()
    shapes = QUICK_SHAPES if args.quick else GPU_SHAPES
    rows, peak = run(shapes, args.quick, jnp.dtype(args.dtype), Recorder.from_args(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention.json").write_text(json.dumps({"peak_tflops": peak, "rows": rows}, indent=2))
    plot(rows, args.out / "attention.png")
    print_table(rows, peak)


if __name__ == "__main__":
    main()
