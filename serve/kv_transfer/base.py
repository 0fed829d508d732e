"""The KV connector interface, in the shape of vLLM V1's KVConnectorBase_V1.

The scheduler side runs in the engine core's scheduler: it learns how many tokens of a request were
computed remotely, records what to load once blocks are allocated, hands the worker one metadata
object per step and decides whether a finished request's blocks may be freed yet. The worker side
owns the KV pools: it loads and saves blocks and reports which transfers finished. A transport is a
subclass; the scheduler only ever calls these methods, so transports plug in without touching it.
"""

from __future__ import annotations

import abc
from typing import Any, Protocol

import msgspec

from pallas_kernels import PagedKVCache
from serve.kv_transfer.stats import KVTransferStats

ALL_LAYERS = -1  # the layers run as one scan: per-layer hooks are called once, for every layer


class Request(Protocol):
    """What a connector reads of a request (serve.core.sequence.Sequence once it carries kv_transfer_params)."""

    request_id: str
    tokens: list[int]
    prompt_len: int
    block_ids: list[int]
    kv_transfer_params: dict[str, Any] | None


class PoolHolder(Protocol):
    """Who owns the KV pools (the model runner): JAX pools are replaced, not mutated, by every step."""

    kv_cache: PagedKVCache


class LoadSpec(msgspec.Struct, array_like=True):
    """One request's blocks to pull this step: remote blocks from `first_remote` on, into these local ones."""

    request_id: str
    local_block_ids: list[int]
    first_remote: int
    params: dict[str, Any]


class SaveSpec(msgspec.Struct, array_like=True):
    """One request whose prompt is computed this step: its blocks to offer after the step."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    prompt_digest: str  # which tokens the blocks hold


class KVConnectorMetadata(msgspec.Struct, array_like=True):
    """What the scheduler side tells the worker side for one step (plain data: it may cross a process)."""

    loads: list[LoadSpec] = msgspec.field(default_factory=list)
    saves: list[SaveSpec] = msgspec.field(default_factory=list)


class KVConnectorBase(abc.ABC):
    """A transport of KV blocks between engines; both sides live in one object per engine."""

    # --- scheduler side -----------------------------------------------------------------------------
    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens of `request`, beyond the `num_computed_tokens` found locally, whose KV a remote engine holds."""

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks were allocated for `request`: remember to load `num_external_tokens` into them."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads and saves (and forget them: each is handed to the worker once)."""

    @abc.abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(free later: the blocks are offered and the worker reports when, kv_transfer_params for the client)."""

    # --- worker side --------------------------------------------------------------------------------
    @abc.abstractmethod
    def register_kv_caches(self, pools: PoolHolder) -> None:
        """Where the engine's KV pools are (every layer stacked on a leading axis)."""

    @abc.abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Begin this step's loads (before the forward pass)."""

    @abc.abstractmethod
    def wait_for_layer_load(self, layer: int) -> None:
        """Block until `layer`'s KV is in place (a whole-pool transport loads every layer at once)."""

    @abc.abstractmethod
    def save_kv_layer(self, layer: int, pools: PagedKVCache, metadata: KVConnectorMetadata) -> None:
        """After `layer` ran: offer the blocks of this step's saves (a whole-pool transport does it once)."""

    @abc.abstractmethod
    def get_finished(self) -> tuple[set[str], set[str]]:
        """(requests whose offered blocks were pulled or expired: free them, requests whose loads completed)."""

    @abc.abstractmethod
    def get_failed_loads(self) -> set[str]:
        """Requests whose loads failed or timed out: the scheduler recomputes them from their local prefix."""

    def get_kv_connector_stats(self) -> KVTransferStats | None:
        """Cumulative transfer counters for /metrics (None: the transport keeps none)."""
        return None
