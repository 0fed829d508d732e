"""EngineArgs.cpu_reserved_cores: the engine-core process's XLA pool leaves that many cores to the frontend."""

import os
from pathlib import Path

import httpx
import pytest

from serve.config import EngineArgs
from serve.engine.core_client import xla_pool_env
from tests.server_helpers import MODEL_NAME, running_server


@pytest.mark.parametrize(
    ("cores", "reserved", "env", "expected"),
    [
        (8, 1, {}, {"PJRT_NPROC": "7"}),
        (2, 1, {}, {"PJRT_NPROC": "1"}),
        (2, 5, {}, {"PJRT_NPROC": "1"}),  # never an empty pool
        (8, 0, {}, {}),  # XLA's default: every core
        (8, 1, {"PJRT_NPROC": "3"}, {}),  # the caller's sizing wins
        (8, 1, {"NPROC": "3"}, {}),
    ],
)
def test_pool_size_leaves_the_reserved_cores(monkeypatch, cores, reserved, env, expected):
    for name in ("PJRT_NPROC", "NPROC"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert xla_pool_env(EngineArgs(cpu_reserved_cores=reserved)) == expected


def xla_pool_threads(pid: int) -> list[int]:
    """Thread ids of XLA's CPU pool (XLA names them tf_XLAEigen) in a process."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return [int(t.name) for t in tasks if (t / "comm").read_text().strip() == "tf_XLAEigen"]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads a process's threads from Linux's /proc")
def test_served_core_runs_xla_on_the_cores_left(monkeypatch):
    """The pool size reaches the core process: its XLA pool has one thread per core left, bound off the
    reserved core while the main thread may run anywhere, and it serves."""
    for name in ("PJRT_NPROC", "NPROC"):
        monkeypatch.delenv(name, raising=False)
    cores = len(os.sched_getaffinity(0))
    with running_server(cpu_reserved_cores=1, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64) as (
        url,
        app,
    ):
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        pid = app.state.server.engine.core.proc.pid
        environ = dict(
            item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
        )
        assert environ["PJRT_NPROC"] == str(max(1, cores - 1))
        pool = xla_pool_threads(pid)
        assert len(pool) == max(1, cores - 1)
        allowed = sorted(os.sched_getaffinity(0))
        assert os.sched_getaffinity(pid) == set(allowed)  # the main thread's
        if len(allowed) > 1:
            assert all(os.sched_getaffinity(tid) == set(allowed[:-1]) for tid in pool)
