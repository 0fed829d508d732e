"""One tenant's flood against another tenant's streams: tenant B's TTFT and inter-token gaps alone, then
while tenant A sends requests as fast as it can (A is limited to a few requests a minute, so nearly all
of its flood is answered 429).

    python -m benchmarks.tenant_flood [--streams 4 --requests 64 --max-tokens 128 --flood-connections 16]

A control phase floods a stub server (another process on the same machine that answers everything 429,
benchmarks/flood_client.py --stub) instead of ours: what B loses there is the 2-core machine's CPU taken
by the flood's client and an HTTP parser, not anything our server does for tenant A.

Starts `python -m serve --config configs/serve/cpu.yaml` with a keys file of two tenants on a free
port, measures B's load alone and under A's flood (benchmarks/flood_client.py, bounded in time and count),
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
from pathlib import Path

import httpx

from benchmarks.flood_client import LIMIT_S
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


def flooded_phase(url: str, flood_url: str, args: argparse.Namespace, stop: Path) -> tuple[dict, dict, float]:
    """B's load on `url` while tenant A floods `flood_url`: B's summary, A's statuses and requests/s."""
    flooder = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.flood_client", flood_url, DEFAULT_MODEL_NAME, KEY_A, str(stop)]
        + ["--connections", str(args.flood_connections)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert flooder.stdout is not None
    if flooder.stdout.readline().strip() != "ready":
        raise RuntimeError("the flood client did not start")
    t0 = time.monotonic()
    b = measure_b(url, args)
    stop.touch()
    out, _ = flooder.communicate(timeout=LIMIT_S + 60)
    statuses = {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}
    return b, statuses, round(sum(statuses.values()) / (time.monotonic() - t0), 1)


def wait_until_answers(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in {timeout:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=4, help="tenant B's concurrent streams")
    p.add_argument("--requests", type=int, default=64, help="tenant B's requests in each phase")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--flood-connections", type=int, default=16, help="tenant A's concurrent clients")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tenant-flood-"))
    (work / "keys.yaml").write_text(KEYS_FILE)
    port = free_port()
    cmd = [sys.executable, "-m", "serve", "--config", "configs/serve/cpu.yaml", "--port", str(port)]
    cmd += ["--api-keys-file", str(work / "keys.yaml")]
    with server(cmd, port, {}, work / "server.log") as url:
        measure_b(url, args)  # warm-up: every shape B's load uses is compiled before anything is timed
        alone = measure_b(url, args)
        flooded, statuses, rate = flooded_phase(url, url, args, work / "stop")
        stub_port = free_port()
        stub = subprocess.Popen([sys.executable, "-m", "benchmarks.flood_client", "--stub", str(stub_port)], cwd=ROOT)
        try:
            stub_url = f"http://127.0.0.1:{stub_port}"
            wait_until_answers(stub_url)
            control, control_statuses, control_rate = flooded_phase(url, stub_url, args, work / "stop-control")
        finally:
            stub.terminate()
    report = {
        "setup": vars(args) | {"config": "configs/serve/cpu.yaml", "model": DEFAULT_MODEL_NAME},
        "b_alone": alone,
        "b_flooded": flooded,
        "b_control": control,
        "a_statuses": statuses,
        "a_requests_per_s": rate,
        "control_statuses": control_statuses,
        "control_requests_per_s": control_rate,
    }
    print(f"tenant A on our server: {sum(statuses.values())} requests ({rate}/s), statuses {statuses}")
    print(f"tenant A on the stub:   {sum(control_statuses.values())} requests ({control_rate}/s)")
    print(f"tenant B: {alone['completed']}, {flooded['completed']} and {control['completed']} of {args.requests} done")
    print(f"{'tenant B (ms)':<14} {'alone':>8} {'flooded':>8} {'ratio':>7} {'control':>8} {'ratio':>7}")
    for label, metric, pct in [("TTFT p50", "ttft", "p50_ms"), ("TTFT p99", "ttft", "p99_ms")] + [
        ("ITL p50", "itl", "p50_ms"),
        ("ITL p99", "itl", "p99_ms"),
    ]:
        a, f, c = alone[metric][pct], flooded[metric][pct], control[metric][pct]
        print(f"{label:<14} {a:>8.2f} {f:>8.2f} {f / a:>6.2f}x {c:>8.2f} {c / a:>6.2f}x")
    out_dir = ROOT / "benchmarks" / "out"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "tenant_flood.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
