"""`jaxinfra serve` / `python -m serve` command-line arguments and the EngineArgs they make."""

from __future__ import annotations

import argparse

from jaxinfra.loading import QUANTIZATION_CHOICES
from serve.config import EngineArgs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxinfra serve", description="OpenAI-compatible server")
    p.add_argument(
        "--model",
        default=None,
        help="local HF directory, training run directory or preset name (default: the embedded model)",
    )
    p.add_argument("--config", help="engine arguments from a YAML file (configs/serve/*.yaml)")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="sequences allowed to wait beyond max-num-seqs; requests past that get 429",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is cut off")
    p.add_argument("--dtype", default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument(
        "--quantization",
        "-q",
        choices=QUANTIZATION_CHOICES,
        default=None,
        help="the checkpoint's quantization method (default: read from its config.json), or int8 / int4 "
        "to round a dense model's linears as it loads (W8A16, W4A16 group 128)",
    )
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV pool off GPU")
    p.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=None,
        help="decode steps per jitted loop when the batch is decode-only and nothing waits",
    )
    p.add_argument("--no-async-scheduling", action="store_true", help="read each step's results before the next")
    p.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default=None,
        help="priority: requests' `priority` field orders admission and preemption (lower first)",
    )
    p.add_argument("--compilation-cache-dir", default=None, help="JAX's persistent compilation cache ('' = off)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-warmup", action="store_true", help="skip compiling all batch shapes at start")
    p.add_argument(
        "--restart-engine",
        action="store_true",
        help="start a new engine core if it dies (in-flight requests still fail)",
    )
    return p


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    overrides = {
        k: v
        for k, v in dict(
            model=args.model,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            dtype=args.dtype,
            block_size=args.block_size,
            quantization=args.quantization,
            kv_cache_memory=args.kv_cache_memory,
            num_scheduler_steps=args.num_scheduler_steps,
            compilation_cache_dir=args.compilation_cache_dir,
            seed=args.seed,
            async_scheduling=False if args.no_async_scheduling else None,
            scheduling_policy=args.scheduling_policy,
        ).items()
        if v is not None
    }
    if args.config:
        return EngineArgs.from_yaml(args.config, **overrides)
    return EngineArgs(**overrides)
