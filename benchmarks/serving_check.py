"""Our server end to end inside a time budget (the serving step of benchmarks/gpu_check.sh).

    python -m benchmarks.serving_check --model llama-3.2-1b --dtype bfloat16 --budget 110 --rows serving.json

Rows, each written as measured: time to healthy (server start -> /health 200) and to the first answer,
with an empty persistent compilation cache and again with the cache the first start filled; then, on
the warm server, random `--input-len`-token prompts (token ids) with `--output-len` tokens and
ignore_eos at each concurrency: output tokens/s, TTFT and TPOT (serving_online's client), and the
decode step's roofline (weights + KV read per step / the copy bandwidth the paged_attention step
measured in the same run) against the median TPOT. A new row starts only if the budget allows it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.budget import Recorder, add_budget_args
from benchmarks.serving_online import run_load, summarize
from benchmarks.serving_vs_vllm import free_port, server
from jaxinfra.loading import DEFAULT_MODEL, load_config


def copy_bandwidth(area: Path | None) -> float | None:
    """The copy bandwidth (GB/s) the paged_attention step wrote to the kernels' area JSON, if any."""
    if area is None or not area.is_file():
        return None
    return json.loads(area.read_text()).get("paged_attention", {}).get("copy_bandwidth_gbs")


def decode_roofline_ms(model: str, dtype: str, seqs: int, context: int, bandwidth_gbs: float) -> float:
    """Fewest milliseconds a decode step can take: every matmul weight once (the embedding table is
    only gathered) plus `seqs` sequences' K and V over `context` tokens, at the copy bandwidth."""
    cfg = load_config(model)
    per = np.dtype(dtype).itemsize if dtype != "bfloat16" else 2
    weights = cfg.num_matmul_params
    kv = seqs * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * per
    return (weights * per + kv) / (bandwidth_gbs * 1e9) * 1e3


@contextmanager
def started(args: argparse.Namespace, cache: Path, log: Path, timeout: float) -> Iterator[tuple[str, dict]]:
    """Our server (stopped on exit, SIGTERM or SIGINT: serving_vs_vllm.server); yields its URL and the
    seconds to healthy and to the first answer (one 1-token request)."""
    port = free_port()
    cmd = [sys.executable, "-m", "serve", "--model", args.model, "--served-model-name", "m", "--port", str(port)]
    cmd += ["--dtype", args.dtype, "--compilation-cache-dir", str(cache), "--max-queue", "4096"]
    cmd += shlex.split(args.server_flags)
    t0 = time.perf_counter()
    with server(cmd, port, {}, log, timeout=timeout) as url:
        healthy = time.perf_counter() - t0
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "ignore_eos": True}
        httpx.post(f"{url}/v1/completions", json=body, timeout=max(timeout - healthy, 10)).raise_for_status()
        yield url, {"healthy_s": healthy, "first_answer_s": time.perf_counter() - t0}


def load_row(url: str, args: argparse.Namespace, concurrency: int, bandwidth: float | None) -> dict[str, Any]:
    """One concurrency level: output tokens/s, TTFT, TPOT and the decode roofline."""
    rng = random.Random(concurrency)
    n = max(args.prompts_per_level * concurrency, args.min_prompts)
    prompts = [[rng.randrange(10, args.vocab) for _ in range(args.input_len)] for _ in range(n)]
    results, seconds = asyncio.run(
        run_load(
            url, "m", prompts, rate=None, arrival="burst", concurrency=concurrency, max_tokens=args.output_len,
            drop_fraction=0.0, api_key=None,
        )
    )  # fmt: skip
    s = summarize(results, seconds)
    row = {"phase": f"load c={concurrency}", "concurrency": concurrency, "requests": n, "completed": s["completed"]}
    row.update(output_tokens_per_s=s["output_tokens_per_s"], seconds=seconds)
    row.update(ttft_p50_ms=s["ttft"].get("p50_ms"), ttft_p99_ms=s["ttft"].get("p99_ms"))
    row.update(tpot_p50_ms=s["tpot"].get("p50_ms"), tpot_p99_ms=s["tpot"].get("p99_ms"))
    if bandwidth and row["tpot_p50_ms"]:
        roof = decode_roofline_ms(args.model, args.dtype, concurrency, args.input_len + args.output_len // 2, bandwidth)
        row.update(roofline_ms=roof, roofline_frac=roof / row["tpot_p50_ms"])
    return row


def run(args: argparse.Namespace, rec: Recorder) -> None:
    """Cold start, warm start, then each concurrency on the warm server, while the budget lasts."""
    bandwidth = copy_bandwidth(args.bandwidth_from)
    rec.note(model=args.model, dtype=args.dtype, copy_bandwidth_gbs=bandwidth)
    work = Path(tempfile.mkdtemp(prefix="serving-check-"))
    logs = args.logs or work
    logs.mkdir(parents=True, exist_ok=True)
    cache = work / "compile-cache"
    with started(args, cache, logs / "server_cold.log", rec.budget - rec.elapsed()) as (_, times):
        rec.add({"phase": "start, empty compile cache", **times})
    if not rec.more(estimate=times["first_answer_s"] * 0.5):
        return
    with started(args, cache, logs / "server_warm.log", rec.budget - rec.elapsed()) as (url, times):
        rec.add({"phase": "start, warm compile cache", **times})
        estimate = None
        for c in args.concurrency:
            if not rec.more(estimate):
                break
            t0 = time.time()
            row = load_row(url, args, c, bandwidth)
            rec.add(row)
            print(json.dumps(row), flush=True)
            estimate = (time.time() - t0) * 2  # the next level has more requests in flight


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.2-1b", help="preset, HF directory or 'default' (the embedded model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    p.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 64, 256])
    p.add_argument("--prompts-per-level", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--bandwidth-from", type=Path, default=None, help="kernels.json with paged_attention's bandwidth")
    p.add_argument("--logs", type=Path, default=None, help="folder for the server logs")
    p.add_argument("--server-flags", default="", help="more `python -m serve` flags, one string")
    add_budget_args(p, "serving")
    args = p.parse_args()
    if args.model == "default":
        args.model = DEFAULT_MODEL
    rec = Recorder.from_args(args)
    try:
        run(args, rec)
    except RuntimeError as e:  # the server did not come up in the budget: say so in the rows
        rec.add({"phase": "server start", "error": str(e)[:300]})
        raise SystemExit(1) from e


if __name__ == "__main__":
    main()
