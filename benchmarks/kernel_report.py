"""What our Pallas kernels compile to on Hopper, without a GPU.

Each kernel is lowered for CUDA on this machine; the Triton IR that JAX embeds in the lowered module
is compiled offline for sm_90a by the `triton` pip package (ttir -> ttgir -> llir -> ptx -> cubin),
and the bundled `ptxas-blackwell -v` reports registers, spill bytes and the kernel's properties.
Prints one row per kernel and shape: registers per thread, spill stores/loads (bytes), shared memory
(bytes, Triton's allocation), and which instructions it uses (wgmma, mma.sync, cp.async, TMA).

    python -m benchmarks.kernel_report [--quick] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from tqdm import tqdm

from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.grouped_matmul import grouped_matmul_pallas
from pallas_kernels.lora_bgmv import bgmv_pallas
from pallas_kernels.lora_sgmv import sgmv_pallas
from pallas_kernels.quant_matmul import int8_matmul_pallas, weight_only_matmul_pallas
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

SM90_SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on H100/H200
S = jax.ShapeDtypeStruct


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """A pallas_call's Triton IR as JAX lowers it for CUDA."""

    name: str
    num_warps: int
    num_stages: int
    ttir: str


@dataclasses.dataclass
class KernelStats:
    kernel: str
    shape: str
    num_warps: int
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    wgmma: bool
    mma_sync: bool
    cp_async: bool
    tma: bool

    @property
    def ok(self) -> bool:
        """No spills, and shared memory within what one block may use."""
        return self.spill_stores == 0 and self.spill_loads == 0 and self.shared_bytes <= SM90_SHARED_LIMIT


def triton_kernels(fn: Callable[..., Any], *args: S) -> list[TritonKernel]:
    """Lower `fn(*args)` for CUDA (no GPU needed) and return the Triton kernels it calls."""
    module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    found: list[TritonKernel] = []

    def visit(op: Any) -> None:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    attrs = inner.operation.attributes
                    if inner.operation.name == "stablehlo.custom_call" and "triton" in str(attrs["call_target_name"]):
                        cfg = ir.DictAttr(attrs["mhlo.backend_config"])
                        found.append(
                            TritonKernel(
                                ir.StringAttr(cfg["name"]).value,
                                ir.IntegerAttr(cfg["num_warps"]).value,
                                ir.IntegerAttr(cfg["num_stages"]).value,
                                _ttir_text(ir.StringAttr(cfg["ir"]).value_bytes),
                            )
                        )
                    visit(inner.operation)

    visit(module.operation)
    return found


def _ttir_text(bytecode: bytes) -> str:
    """The Triton module as text (JAX embeds it as MLIR bytecode; triton's compiler reads text)."""
    ctx = ir.Context()
    tt_dialect.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    with ctx:
        return str(ir.Module.parse(bytecode))


def _ptxas() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")


def compile_sm90(kernel: TritonKernel, shape: str) -> KernelStats:
    """Compile offline for sm_90a; registers and spills from ptxas, shared memory from Triton."""
    import triton
    from triton.backends.compiler import GPUTarget

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{kernel.name}.ttir"
        src.write_text(kernel.ttir)
        compiled = triton.compile(
            str(src),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": kernel.num_warps, "num_stages": kernel.num_stages},
        )
        ptx = compiled.asm["ptx"]
        ptx_path = Path(tmp) / "k.ptx"
        ptx_path.write_text(ptx)
        out = subprocess.run(
            [_ptxas(), "-v", "--gpu-name=sm_90a", str(ptx_path), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr

    def num(pattern: str) -> int:
        m = re.search(pattern, out)
        return int(m.group(1)) if m else 0

    return KernelStats(
        kernel=kernel.name,
        shape=shape,
        num_warps=kernel.num_warps,
        registers=num(r"Used (\d+) registers"),
        spill_stores=num(r"(\d+) bytes spill stores"),
        spill_loads=num(r"(\d+) bytes spill loads"),
        shared_bytes=int(compiled.metadata.shared),
        wgmma="wgmma" in ptx,
        mma_sync="mma.sync" in ptx,
        cp_async="cp.async" in ptx,
        tma="cp.async.bulk.tensor" in ptx,
    )


@dataclasses.dataclass(frozen=True)
class PagedShape:
    """One paged-attention configuration: head dim, query heads per KV head, page size, KV dtype,
    decode (one token per sequence) or prefill (chunks of max_q_len tokens)."""

    head_dim: int
    gqa: int
    block_size: int
    kv: str
    mode: str
    kv_heads: int = 8
    splits: int = 1

    def __str__(self) -> str:
        split = f" split{self.splits}" if self.splits > 1 else ""
        return f"{self.mode} d{self.head_dim} gqa{self.gqa} bs{self.block_size} {self.kv}{split}"

    def args(self) -> tuple[S, ...]:
        seqs, pages = 8, 64
        tokens = seqs if self.mode == "decode" else 512
        h, kh, d = self.kv_heads * self.gqa, self.kv_heads, self.head_dim
        pool_dtype = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}.get(self.kv, jnp.bfloat16)
        pool = S((seqs * pages, self.block_size, kh, d), pool_dtype)
        out = [S((tokens, h, d), jnp.bfloat16), pool, pool, S((seqs, pages), jnp.int32)]
        out += [S((seqs + 1,), jnp.int32), S((seqs,), jnp.int32)]
        if self.kv != "bf16":
            out += [S(pool.shape[:3], jnp.float32)] * 2
        return tuple(out)

    def fn(self) -> Callable[..., Any]:
        max_q_len = 1 if self.mode == "decode" else 512

        def call(q, k, v, bt, cu, lens, *scales):
            kw = dict(k_scales=scales[0], v_scales=scales[1]) if scales else {}
            return ragged_paged_attention(
                q, k, v, bt, cu, lens, max_q_len=max_q_len, num_splits=self.splits, interpret=False, **kw
            )

        return call


def paged_shapes(quick: bool) -> Iterator[PagedShape]:
    """The report's matrix; `quick` keeps the serving shapes (the ones the test checks). Head dims 80
    and 96 read pools of their true width (masked loads, padded to 128 in registers)."""
    yield PagedShape(80, 4, 16, "bf16", "decode")
    yield PagedShape(96, 8, 16, "bf16", "prefill")
    if quick:
        for d, gqa, mode in itertools.product((64, 128), (1, 4, 8), ("decode", "prefill")):
            yield PagedShape(d, gqa, 16, "bf16", mode)
        yield PagedShape(128, 4, 16, "int8", "decode")
        yield PagedShape(128, 4, 16, "fp8", "decode")
        yield PagedShape(128, 4, 16, "bf16", "decode", splits=4)  # split-K: the kernel and its merge
        return
    for d, gqa, bs, kv, mode in itertools.product(
        (64, 128, 256), (1, 4, 8), (16, 32, 64), ("bf16", "int8", "fp8"), ("decode", "prefill")
    ):
        yield PagedShape(d, gqa, bs, kv, mode)
    for d in (64, 128, 256):
        yield PagedShape(d, 4, 16, "bf16", "decode", splits=4)


def flash_shapes(quick: bool) -> Iterator[tuple[str, Callable[..., Any], tuple[S, ...]]]:
    """Forward and backward per head dim; 80 forward and 96 backward at their true width (masked)."""
    for d, passes in [(64, "fb"), (128, "fb"), (80, "f"), (96, "b")] + ([] if quick else [(256, "fb")]):
        q = S((1, 2048, 8, d), jnp.bfloat16)
        kv = S((1, 2048, 2, d), jnp.bfloat16)
        if "f" in passes:
            forward = functools.partial(flash_attention, causal=True, interpret=False)
            yield f"forward d{d} gqa4 T2048", forward, (q, kv, kv)
        if "b" in passes:
            grad = jax.grad(lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=False).sum(), (0, 1, 2))
            yield f"backward d{d} gqa4 T2048", grad, (q, kv, kv)
    for d in (128,) if quick else (64, 128):  # context parallelism: a device's 512 queries, a traced offset
        chunk, offset = S((1, 512, 8, d), jnp.bfloat16), S((), jnp.int32)
        kv = S((1, 2048, 2, d), jnp.bfloat16)
        cp = jax.grad(
            lambda q, k, v, o: flash_attention(q, k, v, q_offset=o, causal=True, interpret=False).sum(), (0, 1, 2)
        )
        yield f"backward d{d} gqa4 T512 of 2048, traced offset", cp, (chunk, kv, kv, offset)


def quant_matmul_shapes(quick: bool) -> Iterator[tuple[str, Callable[..., Any], tuple[S, ...]]]:
    """W4A16 (group 128, zero points), W8A16 (per channel) and W8A8 at decode and prefill M, on
    Llama-8B's q/o (4096 x 4096) and MLP down (14336 -> 4096) shapes."""
    layers = [(4096, 4096)] if quick else [(4096, 4096), (14336, 4096), (4096, 14336)]
    for (k, n), m in itertools.product(layers, (1, 64, 256) if quick else (1, 16, 64, 256)):
        x = S((m, k), jnp.bfloat16)
        w4 = (S((k // 2, n), jnp.uint8), S((k // 128, n), jnp.bfloat16), S((k // 128, n), jnp.uint8))
        yield (
            f"w4a16 g128 M{m} K{k} N{n}",
            functools.partial(weight_only_matmul_pallas, bits=4, interpret=False),
            (x, *w4),
        )
        w8 = (S((k, n), jnp.int8), S((1, n), jnp.bfloat16))
        yield (
            f"w8a16 M{m} K{k} N{n}",
            functools.partial(weight_only_matmul_pallas, zeros=None, bits=8, interpret=False),
            (x, *w8),
        )
        a8 = (S((m, k), jnp.int8), S((m,), jnp.float32), S((k, n), jnp.int8), S((n,), jnp.float32))
        yield (
            f"w8a8 M{m} K{k} N{n}",
            functools.partial(int8_matmul_pallas, out_dtype=jnp.bfloat16, interpret=False),
            a8,
        )


def grouped_matmul_shapes(quick: bool) -> Iterator[tuple[str, Callable[..., Any], tuple[S, ...]]]:
    """The MoE grouped matmul, forward and backward (input and weight gradients), on Qwen3-30B-A3B's
    gate (2048 -> 768) and Mixtral-8x7B's down (14336 -> 4096) expert shapes."""
    shapes = [(4096, 128, 2048, 768)] if quick else [(4096, 128, 2048, 768), (8192, 8, 14336, 4096)]
    for m, g, k, n in shapes:
        args = (S((m, k), jnp.bfloat16), S((g, k, n), jnp.bfloat16), S((g,), jnp.int32))
        fwd = functools.partial(grouped_matmul_pallas, interpret=False)
        yield f"forward M{m} G{g} K{k} N{n}", fwd, args
        bwd = jax.grad(lambda x, w, gs: fwd(x, w, gs).astype(jnp.float32).sum(), (0, 1))
        yield f"backward M{m} G{g} K{k} N{n}", bwd, args


def lora_shapes(quick: bool) -> Iterator[tuple[str, Callable[..., Any], tuple[S, ...]]]:
    """Multi-LoRA's BGMV at decode batches and SGMV at a prefill chunk, 8 adapter slots on Llama-8B's
    q (4096 -> 4096) and MLP down (14336 -> 4096) projections, rank 16 (and 64)."""
    layers = [(4096, 4096)] if quick else [(4096, 4096), (14336, 4096)]
    for (k, n), r in itertools.product(layers, (16,) if quick else (16, 64)):
        pools = (S((8, k, r), jnp.bfloat16), S((8, r, n), jnp.bfloat16), S((8,), jnp.float32))
        for t in (1, 64) if quick else (1, 16, 64, 256):
            args = (S((t, k), jnp.bfloat16), S((t,), jnp.int32), *pools)
            yield f"bgmv T{t} K{k} N{n} R{r}", functools.partial(bgmv_pallas, interpret=False), args
        segs = (S((2048, k), jnp.bfloat16), S((5,), jnp.int32), S((4,), jnp.int32), *pools)
        yield f"sgmv T2048 K{k} N{n} R{r}", functools.partial(sgmv_pallas, interpret=False), segs


def report(quick: bool) -> list[KernelStats]:
    jobs: list[tuple[str, Callable[..., Any], tuple[S, ...]]] = list(flash_shapes(quick))
    jobs += [(str(p), p.fn(), p.args()) for p in paged_shapes(quick)]
    jobs += list(quant_matmul_shapes(quick))
    jobs += list(grouped_matmul_shapes(quick))
    jobs += list(lora_shapes(quick))
    rows = []
    for shape, fn, args in tqdm(jobs, desc="lowering + compiling for sm_90a", unit="shape"):
        for kernel in triton_kernels(fn, *args):
            rows.append(compile_sm90(kernel, shape))
    return rows


def table(rows: list[KernelStats]) -> str:
    head = "| kernel | shape | warps | regs | spill st/ld (B) | smem (KB) | wgmma | mma.sync | cp.async | TMA |"
    lines = [head, "| " + " | ".join(["---"] * 10) + " |"]
    for r in rows:
        lines.append(
            f"| {r.kernel.removeprefix('jaxinfra_')} | {r.shape} | {r.num_warps} | {r.registers} | "
            f"{r.spill_stores}/{r.spill_loads} | {r.shared_bytes / 1024:.0f} | {'y' if r.wgmma else '-'} | "
            f"{'y' if r.mma_sync else '-'} | {'y' if r.cp_async else '-'} | {'y' if r.tma else '-'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="serving shapes and the d128 context-parallel backward")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args()
    rows = report(args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_report.json").write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    print(table(rows))
    bad = [r for r in rows if not r.ok]
    print(f"\n{len(rows)} kernels, {len(bad)} with spills or shared memory over {SM90_SHARED_LIMIT // 1024} KB")


if __name__ == "__main__":
    main()
