"""Training throughput: tokens/s and MFU of the sharded train step (Llama-3.2-1B shape on one GPU).

GPU:   python -m benchmarks.train_throughput --model llama-3.2-1b --seq-len 4096 --batch 4
CPU smoke: python -m benchmarks.train_throughput --quick
MFU = jaxinfra.train.throughput.flops_per_token (PaLM's accounting, the one `jaxinfra train` logs) x
tokens/s, over the measured bf16 matmul peak.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from benchmarks.budget import Recorder, add_budget_args
from benchmarks.common import matmul_peak_tflops, time_fn
from jaxinfra.loading import load_config
from jaxinfra.models import LlamaModel
from jaxinfra.train import OptimConfig, TrainConfig, Trainer
from jaxinfra.train.throughput import flops_per_token
from sharding import MeshConfig, get_rules, make_mesh


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--remat", default="save_dots")
    p.add_argument("--preset", default="dp")
    p.add_argument("--quick", action="store_true", help="tiny model, short sequences (CPU smoke run)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    add_budget_args(p, "train_throughput")
    args = p.parse_args()
    rec = Recorder.from_args(args)
    if args.quick:
        args.model, args.seq_len, args.batch = "tiny-llama", 64, 2
    cfg = load_config(args.model).replace(dtype="float32")
    model = LlamaModel(cfg, nnx.Rngs(0))
    trainer = Trainer(
        model,
        make_mesh(MeshConfig(-1, 1, 1)),
        get_rules(args.preset),
        TrainConfig(OptimConfig(warmup_steps=1, total_steps=1000), remat=args.remat, compute_dtype="bfloat16"),
    )
    del model
    state = trainer.init_state()
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.seq_len + 1))
    batch = trainer.shard_batch(
        dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=np.ones((args.batch, args.seq_len), np.int32))
    )
    holder = {"state": state}

    def step():
        holder["state"], metrics = trainer.step(holder["state"], batch)
        return metrics["loss"]

    t0 = time.time()
    jax.block_until_ready(step())  # compiles
    t1 = time.time()
    jax.block_until_ready(step())
    one = time.time() - t1
    # As many timed steps as the budget leaves room for (2 to 10), the peak measurement counted.
    iters = int(min(2 if args.quick else 10, max(2, (args.budget - rec.elapsed() - 5) / max(one, 1e-3))))
    print(f"compile + first step {t1 - t0:.1f} s, one step {one:.2f} s: timing {iters} steps", flush=True)
    seconds = time_fn(step, warmup=0, iters=iters)
    tokens = args.batch * args.seq_len / seconds
    peak = matmul_peak_tflops(n=256 if args.quick else 8192)
    mfu = flops_per_token(cfg, args.seq_len) * tokens / (peak * 1e12)
    result = {
        "model": args.model,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "remat": args.remat,
        "step_s": seconds,
        "tokens_per_s": tokens,
        "peak_tflops": peak,
        "mfu": mfu,
        "devices": len(jax.devices()),
    }
    rec.add(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_throughput.json").write_text(json.dumps(result, indent=2))
    print(
        f"\ntrain step {args.model} batch {args.batch} x seq {args.seq_len} ({args.remat} remat, bf16 compute): "
        f"{seconds * 1e3:.1f} ms/step, {tokens:,.0f} tokens/s, MFU {100 * mfu:.1f}% of {peak:.0f} TFLOP/s"
    )


if __name__ == "__main__":
    main()
