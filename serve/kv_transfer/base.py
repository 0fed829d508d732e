"""The KV connector interface, in the shape of vLLM V1's KVConnectorBase_V1.

The scheduler side runs in the engine core's scheduler: it learns how many tokens of a request were
computed remotely, records what to load once blocks are allocated, hands the worker one metadata
object per step and decides whether a finished request's blocks may be freed yet. The worker side
owns the KV pools: it loads and saves blocks and reports which transfers finished. A transport is a
subclass; the scheduler only ever calls these methods, so transports plug in without touching it.
"""

from __future__ import annotations

import abc
from typing import Any

import msgspec

from pallas_kernels import PagedKVCache
from serve.sequence import Sequence


class LoadSpec(msgspec.Struct, array_like=True):
    """One request's blocks to pull this step: the remote handle and the local blocks they fill."""

    request_id: str
    local_block_ids: list[int]
    num_tokens: int
    params: dict[str, Any]


class KVConnectorMetadata(msgspec.Struct, array_like=True):
    """What the scheduler side tells the worker side for one step (plain data: it may cross a process)."""

    loads: list[LoadSpec] = msgspec.field(default_factory=list)
    saves: list[str] = msgspec.field(default_factory=list)  # request ids whose blocks to offer after the step


class KVConnectorBase(abc.ABC):
    """A transport of KV blocks between engines; both sides live in one object per engine."""

    # --- scheduler side -----------------------------------------------------------------------------
    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Sequence, num_computed_tokens: int) -> int:
        """Tokens of `request`, beyond the `num_computed_tokens` found locally, whose KV a remote engine holds."""

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks were allocated for `request`: remember to load `num_external_tokens` into them."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads and saves (and forget them: each is handed to the worker once)."""

    @abc.abstractmethod
    def request_finished(self, request: Sequence, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(free later: the blocks are offered and the worker reports when, kv_transfer_params for the client)."""

    # --- worker side --------------------------------------------------------------------------------
    @abc.abstractmethod
    def register_kv_caches(self, pools: PagedKVCache) -> None:
        """The engine's KV pools (every layer stacked on a leading axis)."""

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
