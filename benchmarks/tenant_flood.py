"""One tenant's flood against another tenant's streams: tenant B's TTFT and inter-token gaps alone, then
while tenant A sends requests as fast as it can (A is limited to a few requests a minute, so nearly all
of its flood is answered 429).

    python -m benchmarks.tenant_flood [--streams 4 --requests 32 --max-tokens 128 --flood-connections 16]

Starts `python -m serve --config configs/serve/cpu.yaml` with a keys file of two tenants on a free
port, measures B's load alone and under A's flood (a separate process, bounded in time and count),
prints the table and B's ratios, and writes benchmarks/out/tenant_flood.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.serving_online import make_prompts, run_load, summarize
from benchmarks.serving_vs_vllm import free_port, server
from jaxinfra.loading import DEFAULT_MODEL_NAME

ROOT = Path(__file__).resolve().parents[1]
KEY_A, KEY_B = "sk-flood-tenant-a", "sk-quiet-tenant-b"
KEYS_FILE = f"""tenants:
  a: {{requests_per_minute: 5}}
  b: {{}}
keys:
  {KEY_A}: a
  {KEY_B}: b
"""
FLOOD_LIMIT_S = 120.0  # the flood ends by itself after this long, or after FLOOD_LIMIT_REQUESTS
FLOOD_LIMIT_REQUESTS = 100_000


async def flood(url: str, connections: int, stop_file: Path) -> Counter[int]:
    """Tenant A's flood: `connections` clients each sending small completions back to back until
    `stop_file` exists (or the limits above); returns the count of each status."""
    statuses: Counter[int] = Counter()
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "flood", "max_tokens": 4}
    deadline = time.monotonic() + FLOOD_LIMIT_S
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=connections)) as client:

        async def one_client() -> None:
            while not stop_file.exists() and time.monotonic() < deadline and statuses.total() < FLOOD_LIMIT_REQUESTS:
                try:
                    statuses[(await client.post(f"{url}/v1/completions", json=body, headers=headers)).status_code] += 1
                except httpx.HTTPError:
                    statuses[0] += 1

        await asyncio.gather(*(one_client() for _ in range(connections)))
    return statuses


def measure_b(url: str, args: argparse.Namespace) -> dict:
    prompts = make_prompts(args.requests, "random", 32, seed=0)
    results, seconds = asyncio.run(
        run_load(
            url,
            DEFAULT_MODEL_NAME,
            prompts,
            rate=None,
            arrival="poisson",
            concurrency=args.streams,
            max_tokens=args.max_tokens,
            drop_fraction=0.0,
            api_key=KEY_B,
        )
    )
    return summarize(results, seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=4, help="tenant B's concurrent streams")
    p.add_argument("--requests", type=int, default=32, help="tenant B's requests in each phase")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--flood-connections", type=int, default=16, help="tenant A's concurrent clients")
    p.add_argument("--flood", nargs=2, metavar=("URL", "STOP_FILE"), help=argparse.SUPPRESS)  # the flood process
    args = p.parse_args()
    if args.flood:
        print(json.dumps(asyncio.run(flood(args.flood[0], args.flood_connections, Path(args.flood[1])))))
        return
    work = Path(tempfile.mkdtemp(prefix="tenant-flood-"))
    (work / "keys.yaml").write_text(KEYS_FILE)
    port = free_port()
    cmd = [sys.executable, "-m", "serve", "--config", "configs/serve/cpu.yaml", "--port", str(port)]
    cmd += ["--api-keys-file", str(work / "keys.yaml")]
    with server(cmd, port, {}, work / "server.log") as url:
        measure_b(url, args)  # warm-up: every shape B's load uses is compiled before anything is timed
        alone = measure_b(url, args)
        stop = work / "stop"
        flooder = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.tenant_flood", "--flood", url, str(stop)]
            + ["--flood-connections", str(args.flood_connections)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(2.0)  # the flood is at full speed before B starts
        t0 = time.monotonic()
        flooded = measure_b(url, args)
        stop.touch()
        out, _ = flooder.communicate(timeout=FLOOD_LIMIT_S + 60)
        statuses = {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}
        flood_s = time.monotonic() - t0 + 2.0
    report = {
        "setup": vars(args) | {"config": "configs/serve/cpu.yaml", "model": DEFAULT_MODEL_NAME},
        "b_alone": alone,
        "b_flooded": flooded,
        "a_statuses": statuses,
        "a_requests_per_s": round(sum(statuses.values()) / flood_s, 1),
    }
    rows = [("TTFT p50", "ttft", "p50_ms"), ("TTFT p99", "ttft", "p99_ms"), ("ITL p50", "itl", "p50_ms")]
    rows += [("ITL p99", "itl", "p99_ms")]
    print(f"tenant A: {sum(statuses.values())} requests ({report['a_requests_per_s']}/s), statuses {statuses}")
    print(f"tenant B: {alone['completed']} and {flooded['completed']} of {args.requests} completed")
    print(f"{'tenant B (ms)':<14} {'alone':>10} {'flooded':>10} {'ratio':>7}")
    for label, metric, pct in rows:
        a, f = alone[metric][pct], flooded[metric][pct]
        print(f"{label:<14} {a:>10.2f} {f:>10.2f} {f / a:>6.2f}x")
    out_dir = ROOT / "benchmarks" / "out"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "tenant_flood.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
