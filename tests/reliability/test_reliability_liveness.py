"""Faults in the engine core, one server with --restart-engine: killed before any request, killed
twice while restarting, stopped with SIGSTOP (silent heartbeats), and restarts running out."""

import glob
import os
import signal
import time

import httpx
import pytest

from tests.reliability.reliability_helpers import Tally, background_streams, reliability_server
from tests.server_helpers import MODEL_NAME, eventually

pytestmark = pytest.mark.slow
HEARTBEAT_TIMEOUT_S = 2.0
TALLY = Tally("liveness")


@pytest.fixture(scope="module")
def server():
    with reliability_server(restart_on_failure=True, heartbeat_timeout=HEARTBEAT_TIMEOUT_S, restart_attempts=3) as s:
        yield s
    print("\n" + TALLY.report())


def children() -> set[int]:
    """This process's child processes (spawned from any of its threads)."""
    return {int(p) for f in glob.glob(f"/proc/{os.getpid()}/task/*/children") for p in open(f).read().split()}


def health(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=5).status_code


def kill_starting_core(known: set[int]) -> int:
    """SIGKILL the next core process to appear (one still starting); returns its pid."""
    assert eventually(lambda: bool(children() - known), timeout=30)
    pid = max(children() - known)
    time.sleep(0.5)  # inside its startup
    os.kill(pid, signal.SIGKILL)
    return pid


def test_core_killed_before_any_request_is_restarted(server):
    url, _, engine = server
    assert eventually(lambda: health(url) == 200, timeout=60)
    t0 = time.monotonic()
    os.kill(engine.core.proc.pid, signal.SIGKILL)
    TALLY.probes += 1
    assert eventually(lambda: health(url) == 503, timeout=1.0)
    noticed = time.monotonic() - t0
    assert eventually(lambda: health(url) == 200, timeout=60)
    TALLY.notes.append(f"kill before any request: 503 after {noticed:.2f} s, 200 after {time.monotonic() - t0:.1f} s")
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}, timeout=60)
    assert TALLY.answer(r.status_code) == 200


def test_core_killed_twice_while_restarting_still_recovers(server):
    url, _, engine = server
    restarts, first = engine.restarts, engine.core.proc.pid
    known = children()  # every child now (an earlier test's core may still be exiting), so the next new one is the core
    os.kill(first, signal.SIGKILL)
    for _ in range(2):
        known.add(kill_starting_core(known))
    TALLY.probes += 3
    assert eventually(lambda: health(url) == 200, timeout=90)
    assert engine.restarts == restarts + 1 and engine.fatal is None


def test_stopped_core_is_noticed_within_the_heartbeat_timeout(server):
    url, _, engine = server
    with background_streams(url, count=1, max_tokens=1000) as streams:
        t0 = time.monotonic()
        os.kill(engine.core.proc.pid, signal.SIGSTOP)
        TALLY.probes += 1
        assert eventually(lambda: health(url) == 503, timeout=HEARTBEAT_TIMEOUT_S + 1.0)
        noticed = time.monotonic() - t0
    TALLY.notes.append(f"SIGSTOP noticed after {noticed:.2f} s (heartbeat timeout {HEARTBEAT_TIMEOUT_S:g} s)")
    assert streams[0].done and streams[0].errors[0]["code"] == "engine_dead"
    assert "heartbeat" in streams[0].errors[0]["message"]
    assert eventually(lambda: health(url) == 200, timeout=60)


def test_restarts_running_out_is_fatal():
    """On a server of its own: fatal is for good, and the tests run in random order."""
    fatal: list[str] = []
    with reliability_server(restart_on_failure=True, restart_attempts=1, on_fatal=fatal.append) as (url, _, engine):
        first, known = engine.core.proc.pid, children()
        os.kill(first, signal.SIGKILL)
        kill_starting_core(known)
        TALLY.probes += 2
        assert eventually(lambda: bool(fatal), timeout=30)
        assert engine.fatal == fatal[0] and "could not be restarted" in fatal[0]
        r = httpx.get(f"{url}/health", timeout=5)
        assert r.status_code == 503 and "could not be restarted" in r.json()["error"]
