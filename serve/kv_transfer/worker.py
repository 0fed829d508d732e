"""The engine core's side of a KV connector: loads before a step runs, saves after it is dispatched.

Transports here are synchronous: a step's loads are in the pool before the step is dispatched, and
the scheduler learns which loaded (or failed) in the same engine step, so a request that waited for
its remote KV is scheduled in the next one (vLLM's WAITING_FOR_REMOTE_KVS, one step long).
"""

from __future__ import annotations

import copy

from serve.core.scheduler import Scheduler
from serve.core.step_data import SchedulerOutput
from serve.kv_transfer.base import ALL_LAYERS, KVConnectorBase, KVConnectorMetadata, PoolHolder


class KVTransferWorker:
    """One engine's connector, bound to its model runner's pools and its scheduler."""

    def __init__(self, connector: KVConnectorBase, pools: PoolHolder, scheduler: Scheduler) -> None:
        self.connector = connector
        self.pools = pools
        self.scheduler = scheduler
        connector.register_kv_caches(pools)

    def before_step(self, sched: SchedulerOutput) -> KVConnectorMetadata:
        """This step's connector metadata, its loads done (before the step reads the pool)."""
        meta = self.connector.build_connector_meta(sched)
        if meta.loads:
            self.connector.start_load_kv(meta)
            self.connector.wait_for_layer_load(ALL_LAYERS)
        return meta

    def after_step(self, meta: KVConnectorMetadata | None = None) -> None:
        """After the step was dispatched: offer its saves, hand finished loads to the scheduler, free
        offers pulled or expired (also called while the engine idles, meta None)."""
        if meta is not None and meta.saves:
            self.connector.save_kv_layer(ALL_LAYERS, self.pools.kv_cache, meta)
        _, loaded = self.connector.get_finished()
        failed = self.connector.get_failed_loads()
        if loaded or failed:
            self.scheduler.finish_loads(loaded, failed)

    def poll(self) -> bool:
        """While the engine idles: `after_step` without a step; True if the transfer counters changed."""
        before = copy.deepcopy(self.connector.get_kv_connector_stats())
        self.after_step()
        return self.connector.get_kv_connector_stats() != before
