"""Start-up as a user meets it: seconds from `jaxinfra serve --config configs/serve/cpu.yaml` to /health
and to the first completion answered, with an empty persistent compilation cache (a fresh folder) and
then with that folder warm; also the step shapes the core had compiled by then, and when it had
compiled all of them (/status's step_shapes; warm-up goes on in the background).

    python -m benchmarks.serve_first_answer [--config configs/serve/cpu.yaml] [--runs cold warm]
        [--flags="--no-background-compile"]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.serving_vs_vllm import free_port, running
from jaxinfra.loading import DEFAULT_MODEL_NAME

POLL_S = 0.2
BODY = {"model": DEFAULT_MODEL_NAME, "prompt": "And God said", "max_tokens": 40, "temperature": 0}


def first_answer(config: str, cache_dir: str, log: Path, timeout: float, flags: list[str]) -> dict:
    """Start the server on `cache_dir` (with `flags`), time /health, the first completion and the
    last step shape compiled, then stop it (its whole process group, also when this raises or is
    sent SIGTERM)."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxinfra", "serve", "--config", config, "--port", str(port)]
    cmd += ["--compilation-cache-dir", cache_dir, *flags]
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with running(cmd, {}, log) as proc:
        health = None
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if health is None and httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    health = time.monotonic() - t0
                if health is not None:
                    reply = httpx.post(f"{url}/v1/completions", json=BODY, timeout=timeout)
                    if reply.status_code == 200:
                        answer = time.monotonic() - t0
                        shapes = httpx.get(f"{url}/status", timeout=10).json()["step_shapes"]
                        text = reply.json()["choices"][0]["text"]
                        done = all_compiled(url, t0)
                        return dict(health_s=health, answer_s=answer, shapes_at_answer=shapes, **done, text=text)
            time.sleep(POLL_S)
        raise RuntimeError(f"no answer in {timeout:.0f} s; see {log}")


def all_compiled(url: str, t0: float) -> dict:
    """Seconds from t0 until /status says every step shape is compiled, and how many there are."""
    while True:
        shapes = httpx.get(f"{url}/status", timeout=10).json()["step_shapes"]
        if shapes["compiled"] >= shapes["total"]:
            return dict(all_shapes_s=time.monotonic() - t0, shapes=shapes["total"])
        time.sleep(POLL_S)


def main() -> None:
    """Run cold, then warm, on one fresh cache folder; print a row each."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/serve/cpu.yaml")
    parser.add_argument("--runs", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--flags", default="", help="more `jaxinfra serve` flags, space-separated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jax-cache-") as cache:
        for run in args.runs:
            log = Path(cache).parent / f"first_answer_{run}.log"
            row = first_answer(args.config, cache, log, args.timeout, args.flags.split())
            print(f"{run}: {row}", flush=True)


if __name__ == "__main__":
    main()
