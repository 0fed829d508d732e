"""Quantized matmul benchmark: our W4A16 / W8A16 / W8A8 Pallas kernels (at every M, whatever the
dispatcher would pick) against a bf16 `jnp.dot`, the dispatcher's large-M path (the W4A16 weight
dequantized by XLA, then a bf16 dot: `w4a16_dequant`), and XLA's own int4 path (a native `jnp.int4`
weight converted and scaled before the dot), in one run. W8A8 times the int8 matmul alone: the
activations are quantized before the timed loop (in a model that is a separate, fusable op).

GPU:   python -m benchmarks.quant_matmul --out benchmarks/out
CPU smoke (interpret mode, tiny shapes): python -m benchmarks.quant_matmul --quick
Times are taken on the device (calls chained in one jitted loop, inputs prepared outside), each row is
saved as it ends, and the run stops starting new rows past --budget seconds. For XLA's int4 path the
compiled HLO is searched for a materialized bf16 [K, N] weight: "fused" means XLA folded the int4 ->
bf16 conversion into its GEMM, "materialized" that it wrote the dequantized weight to memory first.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from benchmarks.budget import Recorder, add_budget_args
from benchmarks.common import device_seconds
from pallas_kernels.quant_matmul import DEQUANT_DOT_MIN_M, int8_matmul_pallas, weight_only_matmul_pallas
from pallas_kernels.quant_matmul_reference import (
    dequantize_weight,
    int8_matmul_reference,
    quantize_activations,
    weight_only_matmul_reference,
)

GROUP = 128
GPU_LAYERS = [(4096, 4096), (14336, 4096), (4096, 14336)]  # Llama-3-8B: q/o, MLP down, MLP up (K, N)
GPU_M = [1, 16, 64, 256]
QUICK_LAYERS, QUICK_M = [(256, 128)], [1, 16]


def _weights(k: int, n: int) -> dict[str, jax.Array]:
    ks = jax.random.split(jax.random.key(0), 5)
    return {
        "dense": jax.random.normal(ks[0], (k, n), jnp.bfloat16) * 0.02,
        "u4": jax.random.randint(ks[1], (k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8),
        "s4": jax.random.uniform(ks[2], (k // GROUP, n), jnp.bfloat16, 0.001, 0.01),
        "z4": jax.random.randint(ks[3], (k // GROUP, n), 0, 16, jnp.int32).astype(jnp.uint8),
        "q8": jax.random.randint(ks[4], (k, n), -127, 128, jnp.int32).astype(jnp.int8),
        "s8": jnp.full((1, n), 0.01, jnp.bfloat16),
        "i4": jax.random.randint(ks[1], (k, n), -8, 8, jnp.int32).astype(jnp.int4),
    }


def _xla_int4(x: jax.Array, w: jax.Array, s: jax.Array) -> jax.Array:
    k, n = w.shape
    dense = (w.astype(jnp.bfloat16).reshape(k // GROUP, GROUP, n) * s[:, None]).reshape(k, n)
    return jnp.dot(x, dense, preferred_element_type=jnp.float32).astype(x.dtype)


def _dequant_dot(x: jax.Array, u: jax.Array, s: jax.Array, z: jax.Array) -> jax.Array:
    w = dequantize_weight(u, s, z, bits=4, dtype=x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def xla_int4_fusion(x: jax.Array, w: jax.Array, s: jax.Array) -> str:
    """'fused' or 'materialized': does XLA write the dequantized bf16 weight before its GEMM?"""
    hlo = jax.jit(_xla_int4).lower(x, w, s).compile().as_text()
    k, n = w.shape
    return "materialized" if re.search(rf"= bf16\[{k},{n}\]\{{[^}}]*\}} (fusion|convert|multiply)", hlo) else "fused"


def run(layers: list[tuple[int, int]], ms: list[int], interpret: bool, rec: Recorder, out: Path) -> list[dict]:
    """One row per (K, N, M), handed to `rec` and saved as measured; no new row past the budget."""
    rows = rec.rows
    jobs = [(k, n, m) for k, n in layers for m in ms]
    for k, n, m in tqdm(jobs, desc="quantized matmuls", unit="shape"):
        if not rec.more():
            print(f"{len(jobs) - len(rows)} shapes not run")
            break
        w = _weights(k, n)
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
        xq, xs = quantize_activations(x)  # outside the timed W8A8 call
        s8 = w["s8"][0].astype(jnp.float32)
        # name -> (fn, args); device_seconds perturbs the first argument between chained calls
        fns = {
            "bf16": (lambda x, d: jnp.dot(x, d, preferred_element_type=jnp.float32).astype(x.dtype), (x, w["dense"])),
            "w4a16": (
                lambda x, u, s, z: weight_only_matmul_pallas(x, u, s, z, bits=4, interpret=interpret),
                (x, w["u4"], w["s4"], w["z4"]),
            ),
            "w8a16": (
                lambda x, q, s: weight_only_matmul_pallas(x, q, s, None, bits=8, interpret=interpret),
                (x, w["q8"], w["s8"]),
            ),
            "w8a8": (
                lambda xq, xs, q, s: int8_matmul_pallas(xq, xs, q, s, out_dtype=jnp.bfloat16, interpret=interpret),
                (xq, xs, w["q8"], s8),
            ),
            "w4a16_dequant": (_dequant_dot, (x, w["u4"], w["s4"], w["z4"])),
            "xla_int4": (_xla_int4, (x, w["i4"], w["s4"])),
        }
        row: dict = {"m": m, "k": k, "n": n}
        refs = {
            "w4a16": weight_only_matmul_reference(x, w["u4"], w["s4"], w["z4"], bits=4),
            "w8a16": weight_only_matmul_reference(x, w["q8"], w["s8"], None, bits=8),
            "w8a8": int8_matmul_reference(xq, xs, w["q8"], s8, out_dtype=x.dtype),
        }
        for name, ref in refs.items():  # relative to the output's scale: the kernels must be right first
            err = jnp.max(jnp.abs(fns[name][0](*fns[name][1]).astype(jnp.float32) - ref.astype(jnp.float32)))
            row[f"{name}_err"] = float(err / jnp.maximum(jnp.max(jnp.abs(ref.astype(jnp.float32))), 1e-6))
        for name, (fn, args) in fns.items():
            row[f"{name}_us"] = device_seconds(fn, *args, iters=5 if interpret else 20) * 1e6
        row["xla_int4_fusion"] = xla_int4_fusion(x, w["i4"], w["s4"])
        for name in ("w4a16", "w8a16", "w8a8", "w4a16_dequant", "xla_int4"):
            row[f"{name}_speedup"] = row["bf16_us"] / row[f"{name}_us"]
        rec.add(row)
        out.mkdir(parents=True, exist_ok=True)
        (out / "quant_matmul.json").write_text(json.dumps(rows, indent=2))
        print(
            f"M={m:4d} K={k:5d} N={n:5d}  bf16 {row['bf16_us']:8.1f} us   "
            + "  ".join(f"{nm} {row[f'{nm}_speedup']:.2f}x" for nm in ("w4a16", "w8a16", "w8a8", "w4a16_dequant"))
            + f"  (XLA int4: {row['xla_int4_fusion']})",
            flush=True,
        )
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, n in sorted({(r["k"], r["n"]) for r in rows}):
        sub = [r for r in rows if (r["k"], r["n"]) == (k, n)]
        for name, style in (("w4a16", "-o"), ("w8a16", "--s"), ("w8a8", ":^")):
            ax.plot([r["m"] for r in sub], [r[f"{name}_speedup"] for r in sub], style, label=f"{name} {k}x{n}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("speedup over bf16 jnp.dot")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU smoke)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    add_budget_args(parser, "quant_matmul")
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    layers, ms = (GPU_LAYERS, GPU_M) if on_gpu and not args.quick else (QUICK_LAYERS, QUICK_M)
    rows = run(layers, ms, interpret=not on_gpu, rec=Recorder.from_args(args), out=args.out)
    if rows:
        plot(rows, args.out / "quant_matmul.png")
    print(
        "\nquantized matmul speedup over bf16 jnp.dot (device time; "
        f"the dispatchers use the kernels below M={DEQUANT_DOT_MIN_M})"
    )
    print("| M | K | N | bf16 us | W4A16 | W8A16 | W8A8 | W4A16 dequant+dot | XLA int4 | XLA int4 convert |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['m']} | {r['k']} | {r['n']} | {r['bf16_us']:.1f} | {r['w4a16_speedup']:.2f}x | "
            f"{r['w8a16_speedup']:.2f}x | {r['w8a8_speedup']:.2f}x | {r['w4a16_dequant_speedup']:.2f}x | "
            f"{r['xla_int4_speedup']:.2f}x | "
            f"{r['xla_int4_fusion']} |"
        )


if __name__ == "__main__":
    main()
