"""The `jaxinfra` command line: serve, generate, train, convert, quantize, info, plan-train, plan-serve."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxinfra.config import DTYPES
from jaxinfra.loading import DEFAULT_MODEL
from jaxinfra.sizes import human_size, parse_size
from serve import plan_serve


def _cmd_generate(args: argparse.Namespace) -> int:
    from serve import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    llm = LLM(args.model, dtype=args.dtype or "auto", max_model_len=args.max_model_len)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, out in zip(args.prompt, outputs):
        print(out.outputs[0].text if args.chat else f"{prompt}{out.outputs[0].text}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    import jax

    if args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)
    from sharding import initialize_distributed

    if args.coordinator or os.environ.get("JAXINFRA_COORDINATOR"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU multi-process collectives
    initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    from jaxinfra.train.config import load_run_config
    from jaxinfra.train.loop import train

    cfg = load_run_config(args.config, args.overrides)
    result = train(cfg, progress=not args.no_progress)
    if jax.process_index() == 0:
        loss = "n/a" if result.eval_loss is None else f"{result.eval_loss:.4f}"
        print(
            f"trained {result.start_step} -> {result.final_step} steps; eval loss {loss} "
            f"(unigram entropy {result.unigram_entropy:.4f}); outputs in {result.out_dir}"
        )
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:

    from jaxinfra.loading import load_model

    print(f"wrote {_export(load_model(args.model, dtype=args.dtype), args)}")
    return 0


def _export(model: Any, args: argparse.Namespace, quant_format: str = "compressed-tensors") -> Any:
    """`--out` as a HF directory: weights, config and the source's tokenizer (a preset's byte-level one)."""

    from jaxinfra.checkpoint import export_hf
    from jaxinfra.loading import load_tokenizer

    out = export_hf(
        model,
        args.out,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_size,
        tokenizer_dir=args.model if Path(args.model).is_dir() else None,
        quant_format=quant_format,
    )
    if not Path(args.model).is_dir():
        load_tokenizer(args.model).save(out)
    return out


def _cmd_quantize(args: argparse.Namespace) -> int:

    from jaxinfra.loading import load_config, load_model, load_tokenizer
    from jaxinfra.quant import calibration
    from jaxinfra.quant.quantize import check, check_format, load_quantize_config, quantize_model

    flags = {
        "method": args.method,
        "bits": args.bits,
        "group_size": args.group_size,
        "symmetric": False if args.asymmetric else None,
        "calibration": args.calibration,
        "num_samples": args.num_samples,
        "seq_len": args.seq_len,
        "gptq_act_order": True if args.act_order else None,
    }
    cfg = load_quantize_config(args.config, {k: v for k, v in flags.items() if v is not None}, args.overrides)
    check_format(cfg, args.format)
    check(load_config(args.model), cfg)  # before any weight is read
    if cfg.calibrated:
        calibration.calibration_documents(cfg.calibration)
    model = load_model(args.model, dtype=args.dtype)
    tokenizer = load_tokenizer(args.model)
    quantize_model(model, tokenizer, cfg)
    out = _export(model, args, args.format)
    size = sum(f.stat().st_size for f in Path(out).glob("*.safetensors"))
    print(f"wrote {out} ({cfg.method}, {cfg.bits}-bit, {args.format}; {human_size(size)} of safetensors)")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:

    import jax.numpy as jnp

    from jaxinfra.loading import checkpoint_quantization, load_config

    cfg = load_config(args.model)
    dtype = args.dtype or cfg.dtype
    width = jnp.dtype(dtype).itemsize
    n = cfg.num_params
    method = checkpoint_quantization(Path(args.model)) if Path(args.model).is_dir() else None
    if method is None:
        weights = (f"weight bytes ({dtype})", f"{n * width:,} ({human_size(n * width)})")
    else:  # what the quantized checkpoint really holds (packed weights, scales, zero points, dense rest)
        size = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))
        weights = (f"weight bytes ({method})", f"{size:,} ({human_size(size)}, on disk)")
    rows = [
        ("model", str(args.model)),
        (
            "architecture",
            f"{cfg.model_type}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.num_heads} heads / {cfg.num_kv_heads} kv heads x {cfg.head_dim}, "
            f"mlp {cfg.intermediate_size}, vocab {cfg.vocab_size}"
            + (
                f", {cfg.num_experts} experts x {cfg.moe_intermediate_size} (top-{cfg.num_experts_per_tok})"
                if cfg.num_experts
                else ""
            ),
        ),
        ("parameters", f"{n:,}"),
        *([("active parameters/token (moe)", f"{cfg.num_active_params:,}")] if cfg.num_experts else []),
        ("quantization", method or "none"),
        weights,
        (f"kv-cache bytes/token ({dtype})", f"{cfg.kv_bytes_per_token(width):,}"),
        ("max context", f"{cfg.context_length:,}"),
    ]
    for key, value in rows:
        print(f"{key:<30} {value}")
    return 0


def _cmd_plan_train(args: argparse.Namespace) -> int:
    import jax

    if args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)
    from jaxinfra.loading import load_config
    from jaxinfra.train.memory import format_report, memory_report
    from sharding import AXES, PRESETS, MeshConfig

    mesh = MeshConfig(*(int(x) for x in args.mesh.split(",")))
    presets = sorted(PRESETS) if args.presets == "all" else args.presets.split(",")
    from jaxinfra.train import TrainConfig

    train_cfg = TrainConfig(remat=args.remat, microbatches=args.microbatches)
    rows = memory_report(load_config(args.model), mesh, presets, args.batch, args.seq_len, train_cfg, args.attn_impl)
    print(
        f"{args.model} on mesh {dict(zip(AXES, mesh.shape(len(jax.devices())), strict=True))}, "
        f"batch {args.batch} x {args.seq_len} tokens, remat {args.remat}, {args.microbatches} microbatch(es), "
        f"attention {args.attn_impl}"
    )
    print(format_report(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfra", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="OpenAI-compatible HTTP server (see `jaxinfra serve --help`)", add_help=False)
    model_help = "local Hugging Face directory, training run directory or preset name (default: the embedded model)"
    dtypes = DTYPES

    gen = sub.add_parser("generate", help="generate text with the serving engine")
    gen.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", choices=dtypes, default=None)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    gen.set_defaults(func=_cmd_generate)

    tr = sub.add_parser("train", help="train or fine-tune (resumes from the latest checkpoint)")
    tr.add_argument("--config", default=None, help="recipe YAML (configs/train/*.yaml)")
    tr.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=100 optim.learning_rate=1e-3")
    tr.add_argument("--devices", type=int, default=None, help="virtual CPU devices (CPU only)")
    tr.add_argument("--coordinator", default=None, help="host:port of process 0 for multi-process runs")
    tr.add_argument("--num-processes", type=int, default=None)
    tr.add_argument("--process-id", type=int, default=None)
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.set_defaults(func=_cmd_train)

    conv = sub.add_parser("convert", help="export a model to a Hugging Face directory (safetensors)")
    conv.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    conv.add_argument("--out", required=True, help="output directory")
    conv.add_argument("--dtype", choices=dtypes, default=None)
    conv.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"))
    conv.set_defaults(func=_cmd_convert)

    plan = sub.add_parser("plan-train", help="per-device training memory under each sharding preset")
    plan.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    plan.add_argument("--mesh", default="-1,1,1", help="data,fsdp,tensor sizes (-1 fills)")
    plan.add_argument("--presets", default="all", help="comma-separated presets or 'all'")
    plan.add_argument("--batch", type=int, default=8)
    plan.add_argument("--seq-len", type=int, default=512)
    plan.add_argument("--remat", choices=("none", "full", "save_dots"), default="none")
    plan.add_argument("--microbatches", type=int, default=1)
    plan.add_argument(
        "--attn-impl",
        choices=("pallas", "cudnn", "xla", "reference"),
        default="pallas",
        help="for the activation estimate: flash kernels keep O(T) per head, the others the float32 scores",
    )
    plan.add_argument("--devices", type=int, default=None, help="virtual CPU devices to plan for (CPU only)")
    plan.set_defaults(func=_cmd_plan_train)

    qz = sub.add_parser("quantize", help="quantize a model (RTN, AWQ, GPTQ, SmoothQuant) into a checkpoint vLLM reads")
    qz.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    qz.add_argument("--out", required=True, help="output directory")
    qz.add_argument("--config", default=None, help="YAML (configs/quant/*.yaml); flags and overrides win")
    qz.add_argument("overrides", nargs="*", help="key=value overrides, e.g. gptq_damp=0.05 awq_grid=10")
    qz.add_argument("--method", choices=("rtn", "awq", "gptq", "smoothquant"), default=None)
    qz.add_argument("--bits", type=int, default=None, help="8 or 4 (default 4; smoothquant: 8)")
    qz.add_argument("--group-size", type=int, default=None, help="32, 64, 128 (default) or 0 = per channel")
    qz.add_argument("--asymmetric", action="store_true", help="int4 with zero points")
    qz.add_argument("--act-order", action="store_true", help="GPTQ: rows by decreasing Hessian diagonal")
    qz.add_argument("--calibration", default=None, help="text/JSONL file or directory (default: KJV train split)")
    qz.add_argument("--num-samples", type=int, default=None, help="calibration rows (default 64)")
    qz.add_argument("--seq-len", type=int, default=None, help="tokens per calibration row (default 256)")
    qz.add_argument("--format", choices=("compressed-tensors", "awq", "gptq"), default="compressed-tensors")
    qz.add_argument("--dtype", choices=dtypes, default=None, help="dtype of the unquantized tensors and scales")
    qz.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"))
    qz.set_defaults(func=_cmd_quantize)

    info = sub.add_parser("info", help="parameter count, weight bytes and KV-cache bytes per token")
    info.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    info.add_argument("--dtype", choices=dtypes, default=None)
    info.set_defaults(func=_cmd_info)

    ps = sub.add_parser("plan-serve", help="KV blocks, context and concurrency a GPU serves a model with")
    plan_serve.add_arguments(ps)
    ps.set_defaults(func=plan_serve.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        from serve.http.main import main as serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"jaxinfra {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
