"""Serving capacity planner (`jaxinfra plan-serve`): from a model, a device and a workload to the KV
blocks the engine will allocate, the context it can serve and the concurrency the pool holds.

The block count comes from the engine's own function (serve.core.kv_budget.kv_cache_blocks) fed the
bytes the engine would see on each device: `gpu_memory_utilization` of the device's memory (the
engine-core process sets XLA's allocator fraction to it unless the environment sets one), less the
device's share of the weights and one step's workspace; each device holds 1/TP of the KV heads.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxinfra.config import ModelConfig
from jaxinfra.sizes import parse_size
from jaxinfra.workload import Workload
from serve.core.kv_budget import (
    XLA_SCRATCH_SHARE,
    DeviceMemory,
    engine_max_model_len,
    kv_cache_blocks,
    step_token_budget,
    step_workspace_bytes,
    xla_mem_fraction,
)
from serve.core.runner.sizing import kv_block_bytes
from serve.http.cli_args import add_engine_flags, engine_args_from

if TYPE_CHECKING:
    from serve.config import EngineArgs

MIB = 2**20
GPUS: dict[str, int] = {  # device memory in bytes, as the driver reports it (nvidia-smi's total)
    "h100-80gb": 81559 * MIB,
    "h200": 143771 * MIB,
    "a100-40gb": 40960 * MIB,
    "a100-80gb": 81920 * MIB,
    "l4": 23034 * MIB,
    "l40s": 46068 * MIB,
}
GPU_ALIASES = {"h100": "h100-80gb", "h200-141gb": "h200", "a100": "a100-80gb", "l4-24gb": "l4", "l40s-48gb": "l40s"}
KV_VARIANTS = ("auto", "int8", "fp8")
WEIGHT_VARIANTS = (None, "int8", "int4")
MAX_LEN_MARGIN = 1.2  # recommended max_model_len = 1.2 x the longest request seen
LONG_CONTEXT = 131_072  # plan-serve counts how many sequences of this length fit at once


def gpu_memory(name: str) -> int:
    """Bytes of a GPU from the table (case-insensitive; e.g. H200, H100-80GB, A100-40GB, L4)."""
    key = name.lower().replace(" ", "-")
    key = GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise ValueError(f"unknown --gpu {name!r}; known: {', '.join(GPUS)} (or give --device-memory)")
    return GPUS[key]


@functools.lru_cache(maxsize=16)
def state_bytes(build: Callable[[], Any]) -> int:
    """Bytes of the state of the module `build` makes, built as shapes only: nothing is allocated."""
    import jax
    from flax import nnx

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(nnx.eval_shape(build))))


def weight_bytes(cfg: ModelConfig, quantization: str | None = None) -> int:
    """Bytes of the model's weights as the engine holds them (dense, or rounded to int8/int4 on load)."""
    from flax import nnx

    from jaxinfra.loading import ON_THE_FLY
    from jaxinfra.models import LlamaModel
    from jaxinfra.quant.quantize import QuantizeConfig, quantize_model

    def build() -> LlamaModel:
        model = LlamaModel(cfg, nnx.Rngs(0))
        return (
            model if quantization is None else quantize_model(model, None, QuantizeConfig(**ON_THE_FLY[quantization]))
        )

    return state_bytes(build)


def eagle_head_bytes(cfg: ModelConfig) -> int:
    """Bytes of an EAGLE head's own weights (fc, one layer, norm; it shares the target's embedding and
    LM head). `cfg`: the head's shape."""
    from flax import nnx

    from jaxinfra.models.eagle import EagleHead

    return state_bytes(lambda: EagleHead(cfg, nnx.Rngs(0)))


@dataclasses.dataclass(frozen=True)
class Device:
    """What the engine sees: `total` bytes of device memory (None: off GPU, where the pool takes
    EngineArgs.kv_cache_memory) of which XLA's allocator takes `mem_fraction` (None: as `jaxinfra
    serve` sets it, the environment's fraction, else gpu_memory_utilization)."""

    name: str
    total: int | None
    mem_fraction: float | None = None

    def allocator_limit(self, utilization: float) -> int | None:
        """XLA's bytes_limit on this device when the engine runs with `utilization`."""
        if self.total is None:
            return None
        return int(self.total * (self.mem_fraction or xla_mem_fraction(utilization)))


@dataclasses.dataclass
class ServePlan:
    """One configuration's numbers; bytes are per device unless named otherwise."""

    model: str
    device: str
    tensor_parallel_size: int
    context_parallel_size: int  # devices a step's tokens split over (weights and KV pools replicated)
    kv_cache_dtype: str
    quantization: str | None
    block_size: int
    gpu_memory_utilization: float
    device_bytes: int | None
    allocator_limit: int | None  # XLA's bytes_limit
    usable_bytes: int | None  # what the engine may use: gpu_memory_utilization of the device, within the limit
    xla_scratch_bytes: int | None  # of usable_bytes, kept free for XLA's workspaces and autotuning
    weight_bytes_total: int
    weight_bytes_per_device: int
    workspace_bytes: int  # estimate for one step of max_num_batched_tokens
    kv_bytes_per_token: int  # every layer's K and V (all heads; each device holds 1/TP of them)
    num_blocks: int
    kv_tokens: int
    kv_pool_bytes_per_device: int
    max_model_len_limit: int  # the longest context one request may have (pool and position limit)
    long_sequences: int  # sequences of LONG_CONTEXT tokens the pool holds at once (0: the model stops short)
    concurrency_p50: int  # requests of P50 prompt + output length the pool holds at once (before max_num_seqs)
    concurrency_p99: int
    recommended_max_model_len: int
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan(
    model: str, cfg: ModelConfig, args: EngineArgs, device: Device, workload: Workload, weights: int | None = None
) -> ServePlan:
    """The plan for engine arguments `args` on `device`; `weights`: the bytes of a quantized checkpoint
    (default: the model's weights as `args.quantization` leaves them)."""
    from jaxinfra.loading import load_config

    tp = args.tensor_parallel_size
    if cfg.num_kv_heads % tp:
        raise ValueError(f"num_kv_heads ({cfg.num_kv_heads}) must be divisible by tensor_parallel_size ({tp})")
    if args.quantization and weights is None and cfg.num_experts:
        raise ValueError(f"quantization {args.quantization} rounds dense MLPs, not {cfg.model_type}'s experts")
    weights = weight_bytes(cfg, args.quantization) if weights is None else weights
    spec = args.speculative()
    # a draft model's or EAGLE head's weights, and its KV pool of as many blocks, share the device
    draft = load_config(spec.model) if spec is not None and spec.method != "ngram" and spec.model else None
    if spec is not None and draft is not None:
        weights += eagle_head_bytes(draft) if spec.method == "eagle" else weight_bytes(draft)
    utilization = args.gpu_memory_utilization
    limit = device.allocator_limit(utilization)
    memory = None if limit is None or device.total is None else DeviceMemory(device.total, limit)
    usable = None if memory is None else min(memory.limit, int(memory.total * utilization))
    step_tokens = step_token_budget(args, engine_max_model_len(cfg, args))
    workspace = step_workspace_bytes(cfg, step_tokens, args.max_num_seqs, tp)
    num_blocks = kv_cache_blocks(cfg, args, step_tokens, memory, weights, draft)
    notes = []
    if num_blocks < 1:
        where = (
            "kv_cache_memory"
            if usable is None
            else f"{device.name} after {weights // tp:,} B of weights and {workspace:,} B of step workspace per device"
        )
        raise ValueError(f"{model} does not fit: no KV block fits in what {where} leaves")
    models = [cfg] if draft is None else [cfg, draft]
    block_bytes = sum(kv_block_bytes(m, args.block_size, args.kv_cache_dtype) for m in models)
    per_token = math.ceil(block_bytes / args.block_size)
    tokens = num_blocks * args.block_size
    len_limit = min(tokens, cfg.context_length)

    def concurrency(length: int) -> int:
        return num_blocks // math.ceil(length / args.block_size)

    if concurrency(workload.prompt_p50 + workload.output_p50) > args.max_num_seqs:
        notes.append(f"max_num_seqs ({args.max_num_seqs}) caps the batch below what the pool holds at P50")
    recommended = min(math.ceil(MAX_LEN_MARGIN * workload.longest), len_limit)
    if MAX_LEN_MARGIN * workload.longest > len_limit:
        notes.append(
            f"the longest request ({workload.longest} tokens) x {MAX_LEN_MARGIN} exceeds what fits ({len_limit})"
        )
    return ServePlan(
        model=model,
        device=device.name,
        tensor_parallel_size=tp,
        context_parallel_size=args.context_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        device_bytes=device.total,
        allocator_limit=limit,
        usable_bytes=usable,
        xla_scratch_bytes=None if usable is None else int(usable * XLA_SCRATCH_SHARE),
        weight_bytes_total=weights,
        weight_bytes_per_device=weights // tp,
        workspace_bytes=workspace,
        kv_bytes_per_token=per_token,
        num_blocks=num_blocks,
        kv_tokens=tokens,
        kv_pool_bytes_per_device=num_blocks * block_bytes // tp,
        max_model_len_limit=len_limit,
        long_sequences=concurrency(LONG_CONTEXT) if cfg.context_length >= LONG_CONTEXT else 0,
        concurrency_p50=concurrency(workload.prompt_p50 + workload.output_p50),
        concurrency_p99=concurrency(workload.prompt_p99 + workload.output_p99),
        recommended_max_model_len=recommended,
        notes=notes,
    )


def variants(
    model: str, cfg: ModelConfig, args: EngineArgs, device: Device, workload: Workload, weights: int | None = None
) -> list[ServePlan | str]:
    """The same plan with an int8/fp8 KV cache and with int8/int4 weights (a reason where one cannot
    be); a quantized checkpoint (`weights` given) keeps its weights."""
    out: list[ServePlan | str] = []
    for kv in KV_VARIANTS:
        for quant in WEIGHT_VARIANTS if weights is None else (args.quantization,):
            if (kv, quant) == (args.kv_cache_dtype, args.quantization):
                continue
            changed = dataclasses.replace(args, kv_cache_dtype=kv, quantization=quant)
            try:
                out.append(plan(model, cfg, changed, device, workload, weights))
            except ValueError as e:
                out.append(f"kv {kv}, weights {quant or 'dense'}: {e}")
    return out


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def format_plan(p: ServePlan, others: list[ServePlan | str], workload: Workload) -> str:
    tp = p.tensor_parallel_size
    rows = [
        ("model", p.model),
        (
            "device",
            f"{p.device} ({_gib(p.device_bytes)}), XLA allocator limit {_gib(p.allocator_limit)}, "
            f"the engine's {_gib(p.usable_bytes)}",
        ),
        (
            "settings",
            f"TP {tp}, CP {p.context_parallel_size}, kv_cache_dtype {p.kv_cache_dtype}, "
            f"weights {p.quantization or 'dense'}, block_size {p.block_size}, "
            f"gpu_memory_utilization {p.gpu_memory_utilization}",
        ),
        (
            "weights per device",
            f"{p.weight_bytes_per_device:,} B ({_gib(p.weight_bytes_per_device)}; {_gib(p.weight_bytes_total)} in all)",
        ),
        (
            "step workspace (estimate)",
            f"{_gib(p.workspace_bytes)} per device (one step of max_num_batched_tokens)",
        ),
        ("XLA scratch margin", f"{_gib(p.xla_scratch_bytes)} per device (XLA's workspaces and autotuning)"),
        ("KV bytes per token", f"{p.kv_bytes_per_token:,} B (all layers, K and V)"),
        (
            "KV blocks",
            f"{p.num_blocks:,} x {p.block_size} = {p.kv_tokens:,} tokens ({_gib(p.kv_pool_bytes_per_device)}/device)",
        ),
        ("largest max_model_len", f"{p.max_model_len_limit:,} tokens in one sequence"),
        (f"{LONG_CONTEXT // 1024}K sequences", f"{p.long_sequences:,} at once"),
        ("concurrency at P50", f"{p.concurrency_p50:,} requests of {workload.prompt_p50 + workload.output_p50} tokens"),
        ("concurrency at P99", f"{p.concurrency_p99:,} requests of {workload.prompt_p99 + workload.output_p99} tokens"),
        (
            "recommended max_model_len",
            f"{p.recommended_max_model_len:,} ({MAX_LEN_MARGIN} x the longest request, {workload.longest})",
        ),
    ]
    lines = [f"{k:<27} {v}" for k, v in rows] + [f"note: {n}" for n in p.notes]
    if others:
        lines += [
            "",
            f"{'kv / weights':<16} {'weights/dev':>12} {'blocks':>9} {'KV tokens':>11} {'max len':>9} {'P50':>6} "
            f"{'P99':>6} {LONG_CONTEXT // 1024:>4}K",
        ]
        for o in others:
            if isinstance(o, str):
                lines.append(o)
                continue
            name = f"{o.kv_cache_dtype} / {o.quantization or 'dense'}"
            lines.append(
                f"{name:<16} {_gib(o.weight_bytes_per_device):>12} {o.num_blocks:>9,} {o.kv_tokens:>11,} "
                f"{o.max_model_len_limit:>9,} {o.concurrency_p50:>6,} {o.concurrency_p99:>6,} {o.long_sequences:>5,}"
            )
    return "\n".join(lines)


def _pair(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected P50,P99 token counts, got {text!r}")
    return int(parts[0]), int(parts[1])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`jaxinfra plan-serve`'s flags: the device and the workload, and every engine flag of `jaxinfra
    serve` (generated from EngineArgs, same names and defaults), so a serve command line plans as is."""
    parser.add_argument("--config", help="engine arguments from a YAML file (configs/serve/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="engine arguments as key=value, after --config and flags")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--gpu", default=None, help=f"a GPU from the table: {', '.join(GPUS)}")
    where.add_argument("--device-memory", type=parse_size, default=None, help="device memory, e.g. 80GiB")
    parser.add_argument(
        "--xla-mem-fraction",
        type=float,
        default=None,
        help="XLA allocator share (default: the environment's, else --gpu-memory-utilization as the engine sets it)",
    )
    parser.add_argument("--prompt-len", type=_pair, default=(512, 2048), help="prompt tokens P50,P99")
    parser.add_argument("--output-len", type=_pair, default=(256, 1024), help="output tokens P50,P99")
    parser.add_argument("--requests", default=None, help="JSONL of real requests (prompt_tokens, completion_tokens)")
    parser.add_argument("--json", action="store_true", help="print the plan and its variants as JSON")
    add_engine_flags(parser)


def main(args: argparse.Namespace) -> int:
    """Run `jaxinfra plan-serve` on parsed flags."""
    from jaxinfra.loading import checkpoint_quantization, load_config

    engine = engine_args_from(args)
    cfg = load_config(engine.model)
    weights = None  # a quantized checkpoint's are what it stores: packed weights, scales, the dense rest
    if Path(engine.model).is_dir() and checkpoint_quantization(Path(engine.model)) is not None:
        if engine.quantization:
            raise ValueError(f"{engine.model} is already quantized: drop --quantization")
        weights = sum(f.stat().st_size for f in Path(engine.model).glob("*.safetensors"))
    if engine.dtype != "auto":
        cfg = cfg.replace(dtype=engine.dtype)
    if args.gpu:
        device = Device(args.gpu, gpu_memory(args.gpu), args.xla_mem_fraction)
    elif args.device_memory:
        device = Device("device", args.device_memory, args.xla_mem_fraction)
    else:
        device = Device("cpu", None)
    if engine.attn_impl is None:  # what the engine will run: pallas on a GPU, xla off it
        engine = dataclasses.replace(engine, attn_impl="xla" if device.total is None else "pallas")
    workload = (
        Workload.from_jsonl(args.requests)
        if args.requests
        else Workload.from_percentiles(args.prompt_len, args.output_len)
    )
    main_plan = plan(engine.model, cfg, engine, device, workload, weights)
    others = variants(engine.model, cfg, engine, device, workload, weights)
    if args.json:
        body = {
            "plan": main_plan.to_dict(),
            "workload": dataclasses.asdict(workload),
            "variants": [o if isinstance(o, str) else o.to_dict() for o in others],
        }
        print(json.dumps(body, indent=2))
    else:
        print(format_plan(main_plan, others, workload))
    return 0
