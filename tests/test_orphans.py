"""Nothing of ours outlives a killed server: SIGKILL of `jaxinfra serve` while its engine core is still
loading and compiling leaves no process 10 s later (its channel is a pair of pipes: no file to leave);
a benchmark that started a server stops it when it is itself terminated."""

import contextlib
import glob
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.serving_vs_vllm import free_port
from serve.core.pids import pid_alive
from tests.server_helpers import eventually

ROOT = Path(__file__).resolve().parents[1]


def children(pid: int) -> set[int]:
    """The live children of `pid`, from every thread's list."""
    found = set()
    for f in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError):
            found |= {int(p) for p in Path(f).read_text().split()}
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def start_server(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jaxinfra", "serve", *argv],
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc (Linux)")
def test_a_killed_frontend_leaves_nothing_while_its_core_warms_up(tmp_path):
    """The core is killed with its frontend even in the middle of loading and compiling step shapes
    (before, it looked at its parent only when idle)."""
    port = free_port()
    proc = start_server(["--config", "configs/serve/cpu.yaml", "--port", str(port)], tmp_path / "serve.log")
    try:
        assert eventually(lambda: any("serve.core.core_proc" in cmdline(c) for c in children(proc.pid)), timeout=120), (
            tmp_path / "serve.log"
        ).read_text()[-2000:]
        core = next(c for c in children(proc.pid) if "serve.core.core_proc" in cmdline(c))
        time.sleep(3)  # loading the model or compiling its first step shapes
        with pytest.raises(httpx.HTTPError):  # not serving yet: the core is still loading or compiling
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        proc.kill()
        proc.wait()
        assert eventually(lambda: not pid_alive(core) or cmdline(core) == "", timeout=10)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None


STUB = (
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers()\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)


def test_a_terminated_benchmark_stops_the_server_it_started(tmp_path):
    """benchmarks.serving_vs_vllm.server() under SIGTERM: the server it started is stopped, not orphaned."""
    up = tmp_path / "up"
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from benchmarks.serving_vs_vllm import server
        port = {free_port()}
        with server([sys.executable, "-c", {STUB!r}, str(port)], port, {{}}, Path({str(tmp_path / "server.log")!r})):
            Path({str(up)!r}).write_text("up")
            time.sleep(600)
    """)
    bench = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        assert eventually(up.exists, timeout=60)
        (stub,) = children(bench.pid)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(30) != 0
        assert eventually(lambda: not pid_alive(stub) or cmdline(stub) == "", timeout=10)
    finally:
        bench.kill()
