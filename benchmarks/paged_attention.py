"""Paged attention benchmark: our decode and ragged kernels vs JAX's shipped paged attention and the
jnp gather reference, in one run.

GPU:   python -m benchmarks.paged_attention --out benchmarks/out
CPU smoke (interpret mode, tiny shapes): python -m benchmarks.paged_attention --quick
Decode: achieved GB/s (K/V bytes read / time) against the measured copy bandwidth, per batch size,
context, block size and KV dtype (bf16, int8, fp8 e4m3), for our kernel as the serving step calls it (the
dispatcher's ragged entry). Ragged prefill: TFLOP/s for chunks over a context, against our flash
forward on the same queries and contiguous keys. Every input is a jit
argument prepared before timing (the shipped baseline gets its pools already transposed), times are
taken on the device (calls chained in one jitted loop), and each row is saved and printed as it ends.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from benchmarks.budget import Recorder, add_budget_args
from benchmarks.common import copy_bandwidth_gbs, device_seconds
from pallas_kernels import (
    PagedKVCache,
    PagedMetadata,
    flash_attention,
    kv_bytes_per_element,
    quantize,
    ragged_attention,
)
from pallas_kernels.paged_attention import default_num_splits
from pallas_kernels.paged_attention_reference import paged_attention_reference, ragged_paged_attention_reference
from pallas_kernels.paged_tiles import kernel_work_list
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

H, KH = 32, 8  # Llama-3-8B attention: 32 query heads, 8 KV heads
# (batch, context) pairs: batch 1 to 256, contexts 512 to 32k, within the suite's time budget.
GPU_DECODE = [(1, 32768), (8, 4096), (8, 32768), (64, 512), (64, 4096), (256, 512), (256, 4096)]
QUICK_DECODE = [(2, 64)]


def _pools(num_seqs: int, context: int, bs: int, d: int, kv: str, seed: int = 0):
    pages = -(-context // bs)
    nb = num_seqs * pages
    ks = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(ks[0], (nb, bs, KH, d), jnp.bfloat16)
    v = jax.random.normal(ks[1], (nb, bs, KH, d), jnp.bfloat16)
    tables = jax.random.permutation(ks[2], nb).reshape(num_seqs, pages).astype(jnp.int32)
    scales = {}
    if kv in ("int8", "fp8"):
        dtype = jnp.int8 if kv == "int8" else jnp.float8_e4m3fn
        (k, ksc), (v, vsc) = (quantize(x.reshape(-1, KH, d), dtype) for x in (k, v))
        k, v = k.reshape(nb, bs, KH, d), v.reshape(nb, bs, KH, d)
        scales = {"k_scales": ksc.reshape(nb, bs, KH), "v_scales": vsc.reshape(nb, bs, KH)}
    return k, v, tables, scales


def _kv_bytes(num_seqs: int, context: int, d: int, kv: str) -> int:
    per = kv_bytes_per_element({"int8": "int8", "fp8": "float8_e4m3fn"}.get(kv, "bfloat16"), d)
    return int(2 * num_seqs * context * KH * d * per)


def _shipped(q, kp, vp, tables, lengths, bs, interpret):
    """JAX's shipped paged attention on pools already in its [KH, NB, BS, D] layout."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_paged

    pages = tables.shape[1]
    per_block = min(max(1, 64 // bs), pages)
    splits = math.gcd(pages // per_block, 16)  # its split count must divide the pages per sequence
    q = (q * q.shape[-1] ** -0.5).astype(q.dtype)  # it applies no softmax scale of its own
    return jax_paged(
        q, kp, vp, tables, lengths, pages_per_compute_block=per_block, k_splits=splits, interpret=interpret
    )


def _serving_decode(q, cache, tables, cu, lengths, work):
    """Our decode exactly as the serving step calls it: the dispatcher's ragged entry, one token per
    sequence, the work list built on the host (split-K chosen by the dispatcher)."""
    meta = PagedMetadata(jnp.full(q.shape[:1], -1, jnp.int32), tables, cu, lengths, max_q_len=1, work=work)
    return ragged_attention(q, cache, meta, impl="pallas")


class Results:
    """Rows saved to JSON (ours and the area JSON of `rec`) and printed as each finishes, so a step cut
    off by its time limit keeps them; `more()` is the recorder's budget check."""

    def __init__(self, path: Path, bandwidth: float, rec: Recorder | None = None) -> None:
        self.path, self.data = path, {"copy_bandwidth_gbs": bandwidth, "decode": [], "prefill": []}
        self.rec = rec or Recorder()
        self.rec.note(copy_bandwidth_gbs=bandwidth)
        path.parent.mkdir(parents=True, exist_ok=True)

    def more(self) -> bool:
        """Whether the budget allows another row."""
        return self.rec.more()

    def add(self, kind: str, row: dict) -> None:
        self.data[kind].append(row)
        self.path.write_text(json.dumps(self.data, indent=2))
        self.rec.add({"kind": kind, **row})
        tqdm.write(f"{kind}: {json.dumps(row)}")


def decode_rows(quick: bool, bandwidth: float, results: Results) -> None:
    d = 32 if quick else 128
    interpret = quick or jax.default_backend() != "gpu"
    iters = 2 if quick else 20
    pools = [("bf16", 16), ("int8", 16), ("fp8", 16)] + ([] if quick else [("bf16", 64), ("int8", 64)])
    grid = [(b, c, bs, kv) for b, c in (QUICK_DECODE if quick else GPU_DECODE) for kv, bs in pools]
    for b, c, bs, kv in tqdm(grid, desc="paged decode"):
        if not results.more():
            return
        k, v, tables, scales = _pools(b, c, bs, d, kv)
        q = jax.random.normal(jax.random.key(9), (b, H, d), jnp.bfloat16)
        lengths = jnp.full((b,), c, jnp.int32)
        cu = jnp.arange(b + 1, dtype=jnp.int32)
        work = jnp.asarray(kernel_work_list(np.arange(b + 1, dtype=np.int32), b, 1, np))
        cache = PagedKVCache(k, v, scales.get("k_scales"), scales.get("v_scales"))
        # Everything a call reads is an argument, prepared here, outside the timed region.
        impls: dict[str, tuple] = {"ours": (_serving_decode, (q, cache, tables, cu, lengths, work))}
        if kv == "bf16" and bs == 16:
            kp, vp = (jnp.transpose(x, (2, 0, 1, 3)) for x in (k, v))  # its [KH, NB, BS, D] layout
            shipped = functools.partial(_shipped, bs=bs, interpret=interpret)
            impls["jax_paged"] = (shipped, (q, kp, vp, tables, lengths))
            if b * c <= 2**20:
                impls["jnp_gather"] = (paged_attention_reference, (q, k, v, tables, lengths))
        ref = paged_attention_reference(q.astype(jnp.float32), k, v, tables, lengths, **scales)
        base = {}
        for name, (fn, args) in impls.items():
            if not results.more():
                return
            row: dict = {"batch": b, "context": c, "block": bs, "kv": kv, "impl": name}
            if name == "ours":  # the dispatcher's split-K count (on the GPU: from its SM count)
                row["splits"] = default_num_splits(b, tables.shape[1], bs)
            try:
                err = float(jnp.abs(jax.jit(fn)(*args).astype(jnp.float32) - ref).max())
                t = device_seconds(fn, *args, iters=iters)
            except Exception as e:  # a baseline that cannot run this shape is reported, not fatal
                results.add("decode", {**row, "error": f"{type(e).__name__}: {e}"[:160]})
                continue
            base[name] = t
            gbs = _kv_bytes(b, c, d, kv) / t / 1e9
            row.update(us=t * 1e6, gbs=gbs, frac_bw=gbs / bandwidth, max_err=err)
            if name != "ours" and "ours" in base:
                row["ours_speedup"] = t / base["ours"]
            results.add("decode", row)


def prefill_rows(quick: bool, results: Results) -> None:
    """A prompt chunk over its cached context: our ragged kernel against our flash forward on the same
    queries and the same keys laid out contiguously (the issue's bar: >= 0.7x flash)."""
    d = 32 if quick else 128
    cases = [(16, 48)] if quick else [(512, 4096), (2048, 4096), (2048, 16384)]
    interpret = quick or jax.default_backend() != "gpu"
    for chunk, context in tqdm(cases, desc="ragged prefill"):
        if not results.more():
            return
        k, v, tables, _ = _pools(1, context, 16, d, "bf16")
        q = jax.random.normal(jax.random.key(3), (chunk, H, d), jnp.bfloat16)
        cu, kv = jnp.asarray([0, chunk], jnp.int32), jnp.asarray([context], jnp.int32)
        ours = functools.partial(ragged_paged_attention, block_q=16 if quick else 64, interpret=interpret)
        args = (q, k, v, tables, cu, kv)
        ref = ragged_paged_attention_reference(q.astype(jnp.float32), k, v, tables, cu, kv)
        err = float(jnp.abs(jax.jit(ours)(*args).astype(jnp.float32) - ref).max())
        t = device_seconds(ours, *args, iters=2 if quick else 10)
        # The same keys in sequence order, gathered before timing: flash's contiguous layout.
        kc, vc = (x[tables[0]].reshape(1, -1, KH, d)[:, :context] for x in (k, v))
        flash = functools.partial(flash_attention, causal=True, interpret=interpret)
        t_flash = device_seconds(flash, q[None], kc, vc, iters=2 if quick else 10)
        # each new token i sees context - chunk + i + 1 keys
        keys = chunk * (context - chunk) + chunk * (chunk + 1) / 2
        flops = 4 * H * d * keys
        row = {"chunk": chunk, "context": context, "us": t * 1e6, "tflops": flops / t / 1e12}
        row.update(flash_us=t_flash * 1e6, flash_tflops=flops / t_flash / 1e12, vs_flash=t_flash / t)
        results.add("prefill", {**row, "max_err": err})


def bandwidth_target(batch: int, context: int) -> float | None:
    """Issue 16's bar for our decode, as a fraction of copy bandwidth (None: no bar at this shape)."""
    if batch >= 32 and context >= 4096:
        return 0.85
    return 0.60 if batch >= 8 else None


def print_tables(decode: list[dict], prefill: list[dict], bandwidth: float) -> None:
    print(f"\nmeasured copy bandwidth: {bandwidth:.0f} GB/s")
    print(
        f"{'batch':>5} {'ctx':>6} {'bs':>3} {'kv':>4} {'impl':<10} {'us':>9} {'GB/s':>7} {'%bw':>5} "
        f"{'ours x':>7} {'err':>8} {'target':>9}"
    )
    for r in decode:
        head = f"{r['batch']:>5} {r['context']:>6} {r['block']:>3} {r['kv']:>4} {r['impl']:<10}"
        if "error" in r:
            print(f"{head} n/a: {r['error']}")
            continue
        speedup = f"{r['ours_speedup']:.2f}x" if "ours_speedup" in r else "-"
        bar = bandwidth_target(r["batch"], r["context"]) if r["impl"] == "ours" else None
        target = "-" if bar is None else f"{100 * bar:.0f}% {'met' if r['frac_bw'] >= bar else 'MISS'}"
        print(
            f"{head} {r['us']:>9.1f} {r['gbs']:>7.0f} {100 * r['frac_bw']:>4.0f}% {speedup:>7} {r['max_err']:>8.1e} "
            f"{target:>9}"
        )
    print(f"\n{'chunk':>6} {'context':>8} {'us':>10} {'TFLOP/s':>8} {'flash TF/s':>10} {'vs flash':>8} {'err':>8}")
    for r in prefill:
        print(
            f"{r['chunk']:>6} {r['context']:>8} {r['us']:>10.1f} {r['tflops']:>8.1f} {r['flash_tflops']:>10.1f} "
            f"{r['vs_flash']:>7.2f}x {r['max_err']:>8.1e}"
        )


def plot(decode: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for impl, kv, bs in sorted({(r["impl"], r["kv"], r["block"]) for r in decode if "gbs" in r}):
        pts = sorted(
            (r["batch"] * r["context"], r["frac_bw"])
            for r in decode
            if "gbs" in r and (r["impl"], r["kv"], r["block"]) == (impl, kv, bs)
        )
        ax.plot(*zip(*pts), marker="o", label=f"{impl} {kv} bs={bs}")
    ax.set_xscale("log")
    ax.set_xlabel("cached tokens in the batch")
    ax.set_ylabel("fraction of copy bandwidth")
    ax.set_title("paged decode attention")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, interpret mode (CPU smoke run)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    add_budget_args(parser, "paged_attention")
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gbs(nbytes=2**24 if args.quick else 2**31)
    results = Results(args.out / "paged_attention.json", bandwidth, Recorder.from_args(args))
    decode_rows(args.quick, bandwidth, results)
    prefill_rows(args.quick, results)
    plot(results.data["decode"], args.out / "paged_attention.png")
    print_tables(results.data["decode"], results.data["prefill"], bandwidth)


if __name__ == "__main__":
    main()
