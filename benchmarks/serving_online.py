"""Online serving load generator for any OpenAI-compatible URL (vLLM's benchmark definitions).

    python -m benchmarks.serving_online --url http://127.0.0.1:8000 --model tiny-llama \\
        --num-requests 200 --rate 20 --arrival poisson --prompt shared-prefix --drop-fraction 0.1
    python -m benchmarks.serving_online --local tiny-llama ...   # start our server (python -m serve) first

Streams every request (SSE) and reports request throughput, output tokens/s, TTFT, TPOT and ITL
mean/p50/p90/p99, errors by status, and with --rates a PNG of latency against offered load.
TTFT: request sent -> first token; TPOT: (e2e - TTFT) / (output tokens - 1); ITL: gaps between chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np


@dataclass
class Result:
    status: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    dropped: bool = False
    well_formed: bool = False
    error: str = ""


def make_prompts(n: int, kind: str, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "river", "stone", "light", "over", "under", "quiet", "city", "sings", "of", "and", "morning"]
    shared = " ".join(rng.choice(words) for _ in range(input_len))
    out = []
    for _ in range(n):
        tail = " ".join(
            rng.choice(words)
            for _ in range(
                max(1, input_len // 8 if kind == "shared-prefix" else rng.randint(input_len // 2, input_len * 3 // 2))
            )
        )
        out.append(f"{shared} {tail}" if kind == "shared-prefix" else tail)
    return out


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    drop_after: int | None,
    api_key: str | None,
) -> Result:
    res = Result()
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode()[:200]
                return res
            chunks, done, finish = 0, False, None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"])[:200]
                    break
                if msg.get("usage"):
                    res.output_tokens = msg["usage"]["completion_tokens"]
                for choice in msg.get("choices", []):
                    now = time.perf_counter()
                    finish = choice.get("finish_reason") or finish
                    if res.ttft is None:
                        res.ttft = now - t0
                    elif last is not None:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    res.dropped = True
                    return res  # leaving the block closes the connection mid-stream
            res.well_formed = done and finish is not None and res.output_tokens > 0
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        res.e2e = time.perf_counter() - t0
    return res


async def run_load(
    url: str,
    model: str,
    prompts: list[str] | list[list[int]],
    *,
    rate: float | None,
    arrival: str,
    concurrency: int | None,
    max_tokens: int,
    drop_fraction: float,
    api_key: str | None,
    seed: int = 0,
) -> tuple[list[Result], float]:
    rng = np.random.default_rng(seed)
    limits = httpx.Limits(max_connections=concurrency or len(prompts), max_keepalive_connections=64)
    sem = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def task(prompt: str | list[int]) -> Result:
            drop = int(rng.integers(1, 4)) if rng.random() < drop_fraction else None
            async with sem:
                return await one_request(client, url, model, prompt, max_tokens, drop, api_key)

        t0 = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(task(prompt)))
            if rate and arrival == "poisson":
                await asyncio.sleep(float(rng.exponential(1.0 / rate)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def summarize(results: list[Result], seconds: float) -> dict:
    ok = [r for r in results if r.status == 200 and not r.dropped and r.well_formed]

    def stats(xs: list[float]) -> dict:
        if not xs:
            return {}
        a = np.asarray(xs) * 1e3
        return {
            "mean_ms": float(a.mean()),
            "p50_ms": float(np.percentile(a, 50)),
            "p90_ms": float(np.percentile(a, 90)),
            "p99_ms": float(np.percentile(a, 99)),
        }

    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    return {
        "requests": len(results),
        "completed": len(ok),
        "dropped": sum(r.dropped for r in results),
        "statuses": statuses,
        "server_errors": sum(r.status >= 500 for r in results),
        "malformed": sum(1 for r in results if r.status == 200 and not r.dropped and not r.well_formed),
        "seconds": seconds,
        "request_throughput": len(ok) / seconds,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / seconds,
        "ttft": stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot": stats(tpot),
        "itl": stats([x for r in ok for x in r.itl]),
    }


def print_summary(s: dict, label: str = "") -> None:
    print(
        f"\n{label}requests {s['requests']}  completed {s['completed']}  dropped {s['dropped']}  "
        f"statuses {s['statuses']}  5xx {s['server_errors']}  malformed {s['malformed']}"
    )
    print(
        f"  {s['request_throughput']:.2f} req/s   {s['output_tokens_per_s']:.1f} output tok/s   ({s['seconds']:.1f} s)"
    )
    for key in ("ttft", "tpot", "itl"):
        v = s[key]
        if v:
            print(
                f"  {key.upper():<5} mean {v['mean_ms']:8.1f}  p50 {v['p50_ms']:8.1f}  p90 {v['p90_ms']:8.1f}  "
                f"p99 {v['p99_ms']:8.1f} ms"
            )


@contextlib.contextmanager
def local_server(model: str, out: Path, *flags: str):
    """Our server (`python -m serve`) on a free loopback port, its log in `out`; yields its URL."""
    from benchmarks.serving_vs_vllm import free_port, server

    port = free_port()
    cmd = [sys.executable, "-m", "serve", "--model", model, "--served-model-name", model, "--port", str(port)]
    cmd += ["--max-queue", "4096", *flags]
    out.mkdir(parents=True, exist_ok=True)
    with server(cmd, port, {}, out / "serving_online_server.log") as url:
        yield url


def pool_whole(url: str) -> bool:
    """Whether every KV block is free again (from the server's metrics)."""
    import httpx

    return any(
        line.startswith("jaxinfra:kv_cache_usage_perc") and float(line.split()[-1]) == 0.0
        for line in httpx.get(f"{url}/metrics").text.splitlines()
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None)
    p.add_argument("--local", default=None, metavar="MODEL", help="start our server in-process on this model")
    p.add_argument("--model", default=None, help="model id for requests (default: --local)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--arrival", choices=["poisson", "burst"], default="poisson")
    p.add_argument("--rate", type=float, default=10.0, help="requests/s for poisson arrivals")
    p.add_argument("--rates", default=None, help="comma-separated rates to sweep (writes the PNG)")
    p.add_argument("--concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--prompt", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--input-len", type=int, default=32, help="words per prompt")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--drop-fraction", type=float, default=0.0, help="clients that disconnect mid-stream")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = p.parse_args()
    if not args.url and not args.local:
        p.error("give --url or --local")
    prompts = make_prompts(args.num_requests, args.prompt, args.input_len, seed=0)
    rates = [float(r) for r in args.rates.split(",")] if args.rates else [args.rate]
    with (
        local_server(
            args.local,
            args.out,
            *("--max-model-len", str(args.max_model_len), "--max-num-seqs", "64", "--max-num-batched-tokens", "256"),
        )
        if args.local
        else contextlib.nullcontext(args.url)
    ) as url:
        model = args.model or args.local
        summaries = []
        for rate in rates:
            results, seconds = asyncio.run(
                run_load(
                    url,
                    model,
                    prompts,
                    rate=rate,
                    arrival=args.arrival,
                    concurrency=args.concurrency,
                    max_tokens=args.output_len,
                    drop_fraction=args.drop_fraction,
                    api_key=args.api_key,
                )
            )
            s = summarize(results, seconds)
            s["rate"] = rate
            if args.local:
                deadline = time.monotonic() + 5
                while not pool_whole(url) and time.monotonic() < deadline:
                    time.sleep(0.05)
                s["pool_whole"] = pool_whole(url)
            summaries.append(s)
            print_summary(s, f"[rate {rate:g}/s {args.arrival}] ")
            if "pool_whole" in s:
                print(f"  KV block pool whole afterwards: {s['pool_whole']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving_online.json").write_text(json.dumps(summaries, indent=2))
    if len(summaries) > 1:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for key in ("ttft", "tpot"):
            ax.plot(
                [s["rate"] for s in summaries],
                [s[key].get("p50_ms", np.nan) for s in summaries],
                "o-",
                label=f"{key.upper()} p50",
            )
            ax.plot(
                [s["rate"] for s in summaries],
                [s[key].get("p99_ms", np.nan) for s in summaries],
                "x--",
                label=f"{key.upper()} p99",
            )
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / "serving_online.png", dpi=110)


if __name__ == "__main__":
    main()
