"""CPU paged decode attention: our C++ kernel (`impl="cpu"`) against the XLA formulation it replaced
and the jnp gather reference, in one process, on the embedded model's attention shape (4 heads of 64,
blocks of 16, float32 pools, shuffled block tables). Prints ms per call, the speed-up over XLA and the
achieved GB/s of K/V read against the measured copy bandwidth; writes JSON and a PNG.

    python -m benchmarks.cpu_paged_attention [--quick] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from tqdm.auto import tqdm

from benchmarks.common import copy_bandwidth_gbs, time_fn
from pallas_kernels.cpu_paged_attention import ragged_paged_attention_cpu
from pallas_kernels.paged_attention_reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla

matplotlib.use("Agg")
import matplotlib.pyplot as plt

H, D, BS = 4, 64, 16
IMPLS = {
    "cpu": ragged_paged_attention_cpu,
    "xla": lambda *a: ragged_paged_attention_xla(*a, max_q_len=1),
    "jnp_gather": lambda *a: ragged_paged_attention_reference(*a, max_q_len=1),
}


def inputs(batch: int, context: int, seed: int = 0) -> tuple:
    """A decode batch: `batch` sequences of `context` keys on shuffled pages of a pool with spare blocks."""
    rng = np.random.default_rng(seed)
    pages = -(-context // BS)
    nb = batch * pages + 64
    k = jnp.asarray(rng.standard_normal((nb, BS, H, D), np.float32))
    v = jnp.asarray(rng.standard_normal((nb, BS, H, D), np.float32))
    q = jnp.asarray(rng.standard_normal((batch, H, D), np.float32))
    tables = jnp.asarray(rng.permutation(nb)[: batch * pages].reshape(batch, pages).astype(np.int32))
    cu = jnp.arange(batch + 1, dtype=jnp.int32)
    return q, k, v, tables, cu, jnp.full((batch,), context, jnp.int32)


def rows(quick: bool) -> list[dict]:
    """One row per (batch, context, impl): ms per call and GB/s of K/V read."""
    batches, contexts = ((1, 8), (32,)) if quick else ((1, 16, 64, 256), (128, 1024))
    out = []
    cases = [(b, c) for b in batches for c in contexts]
    for batch, context in tqdm(cases, desc="cpu paged attention", unit="shape"):
        args = inputs(batch, context)
        kv_bytes = 2 * batch * context * H * D * 4
        expected = None
        for name, fn in IMPLS.items():
            if name == "jnp_gather" and batch * context > 64 * 1024:
                continue  # the reference gathers whole tables: minutes at the largest shapes
            jitted = jax.jit(fn)
            result = np.asarray(jitted(*args))
            expected = result if expected is None else expected
            np.testing.assert_allclose(result, expected, atol=1e-4)
            seconds = time_fn(jitted, *args, iters=5 if quick else 20)
            out.append(dict(batch=batch, context=context, impl=name, ms=1e3 * seconds, gbs=kv_bytes / seconds / 1e9))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the tests' smoke run)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gbs(2**24 if args.quick else 2**29)
    table = rows(args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_paged_attention.json").write_text(json.dumps(dict(copy_gbs=bandwidth, rows=table), indent=1))
    xla = {(r["batch"], r["context"]): r["ms"] for r in table if r["impl"] == "xla"}
    print(f"copy bandwidth {bandwidth:.1f} GB/s (read + written)")
    print(f"{'batch':>5} {'ctx':>5} {'impl':<10} {'ms':>8} {'GB/s':>6} {'vs xla':>7}")
    for r in table:
        speedup = xla[(r["batch"], r["context"])] / r["ms"]
        print(f"{r['batch']:>5} {r['context']:>5} {r['impl']:<10} {r['ms']:>8.3f} {r['gbs']:>6.1f} {speedup:>6.2f}x")
    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in IMPLS:
        for context in sorted({r["context"] for r in table}):
            pts = [(r["batch"], r["gbs"]) for r in table if r["impl"] == impl and r["context"] == context]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{impl}, context {context}")
    ax.axhline(bandwidth / 2, color="gray", linestyle="--", label="copy bandwidth (read)")
    ax.set(xscale="log", xlabel="decode batch", ylabel="K/V GB/s", title="CPU paged decode attention")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "cpu_paged_attention.png", dpi=120)


if __name__ == "__main__":
    main()
