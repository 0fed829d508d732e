"""The shared-memory KV connector: KVConnectorBase over shm_transport, for engines of one host.

Prefill engine: a request sent with kv_transfer_params {"do_remote_decode": true} has its prompt's
blocks copied to a shared memory segment in the step that computes the prompt; when it finishes,
the segment is offered (OfferTable) and described in the kv_transfer_params it answers. The device
blocks are free at once (the segment holds the copy); the segment is unlinked when its offer expires
unless a decode engine pulled it first.

Decode engine: a request whose kv_transfer_params describe a segment for its own prompt counts every
prompt token but the last as computed remotely (the last is recomputed to sample the first token),
loads the blocks its local prefix cache lacks before the step, and falls back to recomputing the
prompt if the segment is gone or does not fit. An offer it will not load (its prefix cache holds the
whole prompt, or the request leaves first) is unlinked at once: the prefill engine need not hold it
until it expires (vLLM's decode side notifies its prefill engine likewise).
"""

from __future__ import annotations

import atexit
import hashlib
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import msgspec
import numpy as np

from pallas_kernels import PagedKVCache
from serve.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    LoadSpec,
    PoolHolder,
    Request,
    SaveSpec,
)
from serve.kv_transfer.offers import OfferTable
from serve.kv_transfer.shm_transport import (
    ShmHandle,
    read_blocks,
    release,
    remove_orphans,
    segment_exists,
    write_blocks,
)
from serve.kv_transfer.stats import KVTransferStats


def prompt_digest(tokens: list[int]) -> str:
    """What ties an offer to its prompt: the decode engine never loads KV computed for other tokens."""
    return hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).hexdigest()


class RemotePrefill(msgspec.Struct):
    """The kv_transfer_params a prefill engine answers: where the blocks are and which prompt they hold."""

    handle: ShmHandle
    num_tokens: int
    digest: str


def offer_for(request: Request) -> RemotePrefill | None:
    """The offer the request's kv_transfer_params describe, if it holds this request's own prompt."""
    params = request.kv_transfer_params or {}
    if "handle" not in params:
        return None
    try:
        remote = msgspec.convert(params, RemotePrefill)
    except msgspec.ValidationError:
        return None
    prompt = request.tokens[: request.prompt_len]
    if remote.num_tokens != request.prompt_len or remote.digest != prompt_digest(prompt):
        return None
    return remote


class SharedMemoryConnector(KVConnectorBase):
    """Both roles in one object: a prefill engine uses the save half, a decode engine the load half."""

    def __init__(self, block_size: int, offer_timeout_s: float = 30.0, role: str = "kv_both") -> None:
        self.block_size = block_size
        self.offers = OfferTable(offer_timeout_s)
        self.holder: PoolHolder | None = None
        self.remote_decode: set[str] = set()  # prefill side: requests whose KV a decode engine will pull
        self.saved: dict[str, RemotePrefill] = {}
        self.pending_saves: list[SaveSpec] = []
        self.remote: dict[str, RemotePrefill] = {}  # decode side: usable offers by request
        self.pending_loads: list[LoadSpec] = []
        self.loaded: set[str] = set()
        self.failed: set[str] = set()
        self.stats = KVTransferStats(role)
        self.next_sweep = 0.0  # when to look for segments of killed prefill engines next
        atexit.register(self.close)

    def close(self) -> None:
        """Unlink every segment this engine still holds (it exits: nobody would expire its offers);
        a decode engine that comes for one recomputes the prompt."""
        for offer in self.offers.expire_all():
            release(offer.payload)
        for remote in self.saved.values():
            release(remote.handle)
        self.saved.clear()

    # --- scheduler side -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self.remote_decode.add(request.request_id)
            return 0
        remote = offer_for(request)
        if remote is None:
            return 0
        external = max(request.prompt_len - 1 - num_computed_tokens, 0)
        if external:
            self.remote[request.request_id] = remote
        else:  # the local prefix cache holds the prompt: free the prefill engine's copy now, not at expiry
            release(remote.handle)
            request.kv_transfer_params = None
        return external

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        remote = self.remote.pop(request.request_id, None)
        if remote is None or num_external_tokens == 0:
            return
        end = request.prompt_len - 1
        first = (end - num_external_tokens) // self.block_size
        local = block_ids[first : math.ceil(end / self.block_size)]
        self.pending_loads.append(LoadSpec(request.request_id, local, first, msgspec.to_builtins(remote.handle)))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Loads recorded since the last step; saves for remote-decode rows whose prompt ends this step."""
        out = scheduler_output
        for seq, computed, new in zip(out.seqs, out.num_computed, out.num_new, strict=True):
            if seq.request_id in self.remote_decode and computed < seq.prompt_len <= computed + new:
                blocks = seq.block_ids[: math.ceil(seq.prompt_len / self.block_size)]
                digest = prompt_digest(seq.tokens[: seq.prompt_len])
                self.pending_saves.append(SaveSpec(seq.request_id, blocks, seq.prompt_len, digest))
                self.remote_decode.discard(seq.request_id)
        meta = KVConnectorMetadata(self.pending_loads, self.pending_saves)
        self.pending_loads, self.pending_saves = [], []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.remote_decode.discard(request.request_id)
        unpulled = offer_for(request)  # decode side, left before its load (aborted while waiting): free it
        if unpulled is not None:
            release(unpulled.handle)
        remote = self.saved.pop(request.request_id, None)
        if remote is None:
            return False, None
        self.offers.offer(request.request_id, list(range(remote.handle.num_blocks)), remote.handle)
        return False, msgspec.to_builtins(remote)

    # --- worker side --------------------------------------------------------------------------------
    def register_kv_caches(self, pools: PoolHolder) -> None:
        self.holder = pools

    def _pools(self) -> PoolHolder:
        if self.holder is None:
            raise RuntimeError("register_kv_caches was not called")
        return self.holder

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        holder = self._pools()
        for load in metadata.loads:
            start = time.perf_counter()
            try:
                handle = msgspec.convert(load.params, ShmHandle)
                holder.kv_cache = jax.block_until_ready(
                    read_blocks(handle, holder.kv_cache, load.local_block_ids, load.first_remote)
                )
            except (FileNotFoundError, ValueError, msgspec.ValidationError):
                self.failed.add(load.request_id)
                self.stats.num_failed_transfers += 1
                continue
            self.loaded.add(load.request_id)
            nbytes = handle_nbytes(handle, len(load.local_block_ids))
            self.stats.observe("load", time.perf_counter() - start, nbytes)

    def wait_for_layer_load(self, layer: int) -> None:
        """Loads are synchronous, every layer at once: nothing to wait for."""

    def save_kv_layer(self, layer: int, pools: PagedKVCache, metadata: KVConnectorMetadata) -> None:
        if metadata.saves:
            jax.block_until_ready(pools)  # the step that computed them: not part of the transfer's time
        for save in metadata.saves:
            start = time.perf_counter()
            handle = write_blocks(pools, save.block_ids)
            self.stats.observe("save", time.perf_counter() - start, handle_nbytes(handle, handle.num_blocks))
            replaced = self.saved.get(save.request_id)
            if replaced is not None:  # computed again after a preemption: the newer copy is offered
                release(replaced.handle)
            self.saved[save.request_id] = RemotePrefill(handle, save.num_tokens, save.prompt_digest)

    def get_finished(self) -> tuple[set[str], set[str]]:
        for request_id, offer in list(self.offers.offers.items()):
            if not segment_exists(offer.payload.segment):
                self.offers.pulled(request_id)
        for offer in self.offers.expire():
            release(offer.payload)
        if time.monotonic() >= self.next_sweep:  # at start, then once an offer timeout
            remove_orphans(self.offers.timeout_s)
            self.next_sweep = time.monotonic() + self.offers.timeout_s
        offers, stats = self.offers, self.stats
        stats.blocks_offered, stats.blocks_pulled = offers.blocks_offered, offers.blocks_pulled
        stats.blocks_expired, stats.blocks_held = offers.blocks_expired, offers.num_held_blocks
        loaded, self.loaded = self.loaded, set()
        return set(), loaded

    def get_failed_loads(self) -> set[str]:
        failed, self.failed = self.failed, set()
        return failed

    def get_kv_connector_stats(self) -> KVTransferStats:
        return self.stats


def handle_nbytes(handle: ShmHandle, num_blocks: int) -> int:
    """Bytes `num_blocks` of the handle's blocks take (every array)."""
    per_block = sum(jnp.dtype(s.dtype).itemsize * math.prod(s.shape) for s in handle.arrays) // handle.num_blocks
    return per_block * num_blocks
