"""One long prompt through our server inside a time budget (the serving_128k step of benchmarks/gpu_check.sh).

    python -m benchmarks.long_context_check --model llama-3.1-8b --context 130944 --budget 240 --rows serving.json

Rows, each written as measured, on one server (warm-up included in the step's time): a `--context`-token
prompt of random token ids streamed to `--output-len` tokens: TTFT, prefill TFLOP/s (the prompt's matmul
and causal-attention FLOPs over TTFT) against the bf16 matmul peak the train_throughput step measured in
the same run, and TPOT against the decode roofline at that context (weights + one sequence's KV read per
step at the copy bandwidth the paged_attention step measured); then a second question on the same
document (its last 64 tokens changed): its TTFT against the first, i.e. what the prefix cache saves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.budget import Recorder, add_budget_args
from benchmarks.serving_check import copy_bandwidth, decode_roofline_ms, started
from benchmarks.serving_online import run_load, summarize
from jaxinfra.config import ModelConfig
from jaxinfra.loading import load_config


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """FLOPs of one causal prefill of `tokens` tokens: 2 per matmul weight per token (the embedding
    table is only gathered) plus QK^T and PV over the causal half of the score matrix."""
    weights = cfg.num_matmul_params
    attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens  # 2 matmuls x 2 FLOPs x T^2 / 2
    return 2.0 * weights * tokens + attention


def matmul_peak(area: Path | None) -> float | None:
    """The bf16 matmul peak (TFLOP/s) the train_throughput step wrote to training.json, if any."""
    if area is None or not area.is_file():
        return None
    return json.loads(area.read_text()).get("train_throughput", {}).get("peak_tflops")


def one_prompt(url: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    """Stream one prompt: TTFT, TPOT (p50) and output tokens, as serving_online measures them."""
    results, seconds = asyncio.run(
        run_load(
            url, "m", [prompt], rate=None, arrival="burst", concurrency=1, max_tokens=output_len,
            drop_fraction=0.0, api_key=None,
        )
    )  # fmt: skip
    s = summarize(results, seconds)
    if s["completed"] != 1:
        raise RuntimeError(f"the {len(prompt)}-token prompt failed: {[r.error for r in results]}")
    return {"ttft_ms": s["ttft"]["p50_ms"], "tpot_ms": s["tpot"].get("p50_ms"), "seconds": seconds}


def run(args: argparse.Namespace, rec: Recorder) -> None:
    """Start the server, then the long prompt and the second question, while the budget lasts."""
    cfg = load_config(args.model)
    bandwidth, peak = copy_bandwidth(args.bandwidth_from), matmul_peak(args.peak_from)
    rec.note(model=args.model, dtype=args.dtype, context=args.context, copy_bandwidth_gbs=bandwidth, peak_tflops=peak)
    work = Path(tempfile.mkdtemp(prefix="long-context-check-"))
    logs = args.logs or work
    logs.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    document = [rng.randrange(10, min(args.vocab, cfg.vocab_size)) for _ in range(args.context)]
    with started(args, work / "compile-cache", logs / "server.log", rec.budget - rec.elapsed()) as (url, times):
        rec.add({"phase": "start", **times})
        if not rec.more(estimate=0.0):
            return
        first = one_prompt(url, document, args.output_len)
        flops = prefill_flops(cfg, args.context)
        row: dict[str, Any] = {"phase": f"{args.context}-token prompt", "context": args.context, **first}
        row.update(prefill_tflops=flops / (first["ttft_ms"] / 1e3) / 1e12)
        if peak:
            row.update(prefill_frac_of_peak=row["prefill_tflops"] / peak)
        if bandwidth and first["tpot_ms"]:
            roof = decode_roofline_ms(args.model, args.dtype, 1, args.context + args.output_len // 2, bandwidth)
            row.update(roofline_ms=roof, tpot_over_roofline=first["tpot_ms"] / roof)
        rec.add(row)
        print(json.dumps(row), flush=True)
        if not rec.more(estimate=first["ttft_ms"] / 1e3 * 0.2):
            return
        question = document[:-64] + [rng.randrange(10, min(args.vocab, cfg.vocab_size)) for _ in range(64)]
        second = one_prompt(url, question, args.output_len)
        row = {"phase": "second question, same document", "context": args.context, **second}
        row.update(ttft_over_first=second["ttft_ms"] / first["ttft_ms"])
        rec.add(row)
        print(json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b", help="preset or HF directory")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=130944, help="prompt tokens (128K less room for the output)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    p.add_argument("--bandwidth-from", type=Path, default=None, help="kernels.json with paged_attention's bandwidth")
    p.add_argument("--peak-from", type=Path, default=None, help="training.json with train_throughput's matmul peak")
    p.add_argument("--logs", type=Path, default=None, help="folder for the server log")
    p.add_argument("--server-flags", default="", help="more `python -m serve` flags, one string")
    add_budget_args(p, "serving_128k")
    args = p.parse_args()
    t0 = time.time()
    run(args, Recorder.from_args(args))
    print(f"long_context_check: {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
