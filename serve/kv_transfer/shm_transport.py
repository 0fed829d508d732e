"""KV blocks between engine processes of one host, through POSIX shared memory.

The prefill engine gathers a request's blocks (every layer; int8/fp8 scales too) into one shared
memory segment and hands out a `ShmHandle`, a msgspec struct that travels as JSON in
`kv_transfer_params` (no pickle anywhere). The decode engine attaches, scatters the blocks into its
own pool and unlinks the segment; the prefill engine unlinks segments nobody pulled when their
offer expires. Segments are untracked by Python's resource tracker: their owner is the offer, not a
process, so a segment outlives the process that wrote it until it is pulled or expired.
"""

from __future__ import annotations

import os
import time
import uuid
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import jax.numpy as jnp
import msgspec
import numpy as np

from pallas_kernels import PagedKVCache
from serve.core.pids import creator_gone
from serve.kv_transfer.blocks import block_axis, gather_blocks, padded_ids, pool_fields, scatter_blocks

ALIGN = 64  # each array starts on a cache line


class ArraySpec(msgspec.Struct, array_like=True):
    """One pool array's gathered blocks inside the segment."""

    field: str
    dtype: str
    shape: list[int]
    offset: int


class ShmHandle(msgspec.Struct):
    """Where a request's offered blocks are: what the decode engine needs to pull them."""

    segment: str
    arrays: list[ArraySpec]
    num_blocks: int

    def to_params(self) -> dict[str, Any]:
        """As JSON-ready kv_transfer_params."""
        return msgspec.to_builtins(self)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> ShmHandle:
        """From kv_transfer_params (ValueError naming the field if malformed)."""
        try:
            return msgspec.convert(params, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"kv_transfer_params: {e}") from e


SEGMENT_PREFIX = "jaxinfra-kv-"
SHM_DIR = "/dev/shm"  # where POSIX shared memory segments are files (Linux)


def remove_orphans(older_than_s: float, root: str = SHM_DIR) -> list[str]:
    """Unlink the segments of prefill engines that are gone (SIGKILLed: no exit handler released them)
    and older than `older_than_s` (the offer timeout: no decode engine may still pull them). Returns
    their names."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return removed
    now = time.time()
    for entry in entries:
        if not creator_gone(entry.name, SEGMENT_PREFIX):
            continue
        try:
            if now - entry.stat().st_mtime > older_than_s:
                os.unlink(entry.path)
                removed.append(entry.name)
        except FileNotFoundError:
            pass  # pulled meanwhile
    return removed


def _untracked(shm: SharedMemory) -> SharedMemory:
    """`shm` without the resource tracker's unlink at process exit (Python < 3.13 has no track=False)."""
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _unlink(shm: SharedMemory) -> None:
    """Unlink an untracked segment: unlink() tells the resource tracker to forget it, so it is
    registered back first (else the tracker prints a KeyError for every segment)."""
    resource_tracker.register(shm._name, "shared_memory")  # type: ignore[attr-defined]
    shm.unlink()


def write_blocks(pool: PagedKVCache, block_ids: list[int]) -> ShmHandle:
    """Copy `block_ids` of `pool` into a new shared memory segment."""
    blocks = gather_blocks(pool, jnp.asarray(padded_ids(block_ids)))
    keep = (slice(None),) * block_axis(pool) + (slice(len(block_ids)),)
    arrays = {name: np.asarray(a)[keep] for name, a in pool_fields(blocks).items()}
    specs, offset = [], 0
    for name, a in arrays.items():
        specs.append(ArraySpec(name, a.dtype.name, list(a.shape), offset))
        offset += -(-a.nbytes // ALIGN) * ALIGN
    name = f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:16]}"  # the creator's pid: see remove_orphans
    shm = _untracked(SharedMemory(name, create=True, size=max(offset, 1)))
    try:
        for spec in specs:
            a = arrays[spec.field]
            np.ndarray(a.shape, a.dtype, shm.buf, spec.offset)[...] = a
    finally:
        shm.close()
    return ShmHandle(shm.name, specs, len(block_ids))


def read_blocks(handle: ShmHandle, pool: PagedKVCache, block_ids: list[int], first: int = 0) -> PagedKVCache:
    """`pool` with the handle's blocks `first`, `first + 1`, ... written at `block_ids` (the ones before
    `first` were in the local prefix cache); the segment is unlinked (pulled). FileNotFoundError if it
    is gone (expired): the caller recomputes instead."""
    if first < 0 or first + len(block_ids) > handle.num_blocks:
        raise ValueError(f"kv_transfer_params: {handle.num_blocks} blocks offered, {first + len(block_ids)} needed")
    shm = _untracked(SharedMemory(handle.segment))
    axis = block_axis(pool)
    take = first + padded_ids(list(range(len(block_ids))))
    try:
        fields = {
            s.field: jnp.asarray(np.take(np.ndarray(tuple(s.shape), jnp.dtype(s.dtype), shm.buf, s.offset), take, axis))
            for s in handle.arrays
        }
    finally:
        shm.close()
        _unlink(shm)
    expected = pool_fields(pool)
    if fields.keys() != expected.keys() or any(fields[n].dtype != a.dtype for n, a in expected.items()):
        raise ValueError(f"kv_transfer_params: blocks of {sorted(fields)} do not fit this engine's KV pool")
    blocks = PagedKVCache(**fields)
    return scatter_blocks(pool, jnp.asarray(padded_ids(block_ids)), blocks)


def release(handle: ShmHandle) -> bool:
    """Unlink an offer's segment; False if the decode engine had already pulled it."""
    try:
        shm = _untracked(SharedMemory(handle.segment))
    except FileNotFoundError:
        return False
    shm.close()
    _unlink(shm)
    return True


def segment_exists(name: str) -> bool:
    """Whether the segment is still there (not yet pulled nor released)."""
    try:
        _untracked(SharedMemory(name)).close()
    except FileNotFoundError:
        return False
    return True
