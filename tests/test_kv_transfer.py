"""KV transfer for prefill/decode disaggregation: blocks arrive bitwise (shared memory between
processes, device_put between meshes; bf16 and int8 KV), and offers nobody pulls expire."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from serve.kv_transfer.offers import OfferTable
from serve.kv_transfer.shm_transport import (
    SEGMENT_PREFIX,
    SHM_DIR,
    ShmHandle,
    read_blocks,
    release,
    remove_orphans,
    segment_exists,
    write_blocks,
)
from tests.check_scripts import run_check
from tests.kv_transfer.pools import blocks_of, random_pool

ROOT = Path(__file__).parent.parent
SRC_IDS, DST_IDS = [6, 1, 3], [5, 1, 3]


def test_shm_blocks_cross_processes_bitwise():
    r = run_check("tests.kv_transfer.shm_writer", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    handles = json.loads(r.stdout.splitlines()[-1])
    for kind, params in handles.items():
        handle = ShmHandle.from_params(params)
        assert segment_exists(handle.segment)  # outlived its writer
        dst = random_pool(kind, 1)
        untouched = blocks_of(dst, [0, 2, 4, 6, 7])
        dst = read_blocks(handle, dst, DST_IDS)
        expected, got = blocks_of(random_pool(kind, 0), SRC_IDS), blocks_of(dst, DST_IDS)
        assert got.keys() == expected.keys() == ({"k", "v"} if kind == "bf16" else {"k", "v", "k_scale", "v_scale"})
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name])
            np.testing.assert_array_equal(blocks_of(dst, [0, 2, 4, 6, 7])[name], untouched[name])
        assert not segment_exists(handle.segment)  # pulled: unlinked
        assert not release(handle)  # the owner's expiry finds nothing left to free


def test_shm_expired_offer_is_unlinked_and_pull_fails_cleanly():
    handle = write_blocks(random_pool("bf16", 0), [2])
    assert release(handle)  # never pulled: the expiry frees it
    assert not segment_exists(handle.segment)
    with pytest.raises(FileNotFoundError):  # the decode side then recomputes
        read_blocks(handle, random_pool("bf16", 1), [4])


def test_segments_of_a_killed_prefill_engine_are_swept_after_the_offer_timeout(tmp_path):
    """A SIGKILLed prefill engine releases nothing: its segments (named by its pid) are unlinked by the
    next connector's sweep once older than the offer timeout; a live engine's and young ones stay."""
    handle = write_blocks(random_pool("bf16", 0), [2])
    try:
        assert handle.segment.startswith(f"{SEGMENT_PREFIX}{os.getpid()}-")
        assert handle.segment not in remove_orphans(0.0)  # its creator (this process) is alive
        assert os.path.exists(os.path.join(SHM_DIR, handle.segment))
    finally:
        release(handle)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # exited: no process has this id now
    names = {"old, dead": f"{pid}-ab", "young, dead": f"{pid}-cd", "old, alive": f"{os.getpid()}-ef", "no pid": "x-ab"}
    for what, name in names.items():
        path = tmp_path / f"{SEGMENT_PREFIX}{name}"
        path.write_bytes(b"kv")
        if what != "young, dead":
            os.utime(path, (0, 0))
    assert remove_orphans(30.0, str(tmp_path)) == [f"{SEGMENT_PREFIX}{pid}-ab"]
    left = {p.name[len(SEGMENT_PREFIX) :] for p in tmp_path.iterdir()}
    assert left == {names["young, dead"], names["old, alive"], names["no pid"]}


def test_shm_handle_mismatch_is_a_clear_error():
    handle = write_blocks(random_pool("int8", 0), [2, 3])
    try:
        with pytest.raises(ValueError, match="2 blocks offered, 3 needed"):
            read_blocks(handle, random_pool("int8", 1), [4], first=2)
        with pytest.raises(ValueError, match="do not fit this engine's KV pool"):
            read_blocks(handle, random_pool("bf16", 1), [4, 5])
    finally:
        release(handle)
    with pytest.raises(ValueError, match="kv_transfer_params"):
        ShmHandle.from_params({"segment": 3})


@pytest.mark.slow
def test_device_transfer_between_meshes_bitwise():
    r = run_check("tests.kv_transfer.device_check", timeout=600)
    assert r.returncode == 0 and "DEVICE_OK" in r.stdout, r.stderr[-3000:]


def test_offer_table_expires_unpulled_blocks():
    now = [100.0]
    table = OfferTable(timeout_s=5.0, clock=lambda: now[0])
    table.offer("a", [1, 2, 3], payload="seg-a")
    now[0] = 102.0
    table.offer("b", [4])
    with pytest.raises(ValueError, match="already has offered blocks"):
        table.offer("b", [5])
    assert table.num_held_blocks == 4 and table.expire() == []
    pulled = table.pulled("b")
    assert pulled is not None and pulled.block_ids == (4,)
    now[0] = 105.0
    (gone,) = table.expire()
    assert (gone.request_id, gone.block_ids, gone.payload) == ("a", (1, 2, 3), "seg-a")
    assert table.pulled("a") is None  # too late: already freed
    assert len(table) == 0 and table.num_held_blocks == 0
    assert (table.blocks_offered, table.blocks_pulled, table.blocks_expired) == (4, 1, 3)
    with pytest.raises(ValueError, match="timeout_s"):
        OfferTable(timeout_s=0)
