"""The KV connector's counters on /metrics, rendered from the core's latest cumulative KVTransferStats.

Named after vLLM's NIXL connector metrics (vllm:nixl_xfer_time_seconds, _bytes_transferred,
_num_failed_transfers) with kv_transfer_ for nixl_, labelled by the engine's kv_role; the offer
counters (blocks offered / pulled / expired) and per-role queue lengths are this transport's own.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from serve.kv_transfer.stats import OPS, XFER_TIME_BUCKETS
from serve.types import SchedulerStats


class KVTransferMetrics:
    """A Prometheus collector: nothing until a core with a KV connector reports."""

    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str) -> None:
        self.prefix = prefix
        self.model_name = model_name
        self.stats: SchedulerStats | None = None
        registry.register(self)

    def observe(self, stats: SchedulerStats) -> None:
        if stats.kv_transfer is not None:
            self.stats = stats

    def collect(self) -> Iterator[Metric]:
        if self.stats is None or self.stats.kv_transfer is None:
            return
        s, kv, p = self.stats, self.stats.kv_transfer, self.prefix
        labels, values = ["model_name", "kv_role"], [self.model_name, kv.role]
        nbytes = CounterMetricFamily(
            f"{p}:kv_transfer_bytes", "KV bytes moved, by op (save, load).", labels=[*labels, "op"]
        )
        xfer = HistogramMetricFamily(
            f"{p}:kv_transfer_xfer_time_seconds", "Time to move one request's KV blocks, by op.", labels=[*labels, "op"]
        )
        for op in OPS:
            nbytes.add_metric([*values, op], kv.bytes[op])
            cumulative, buckets = 0, []
            for le, n in zip([*map(str, XFER_TIME_BUCKETS), "+Inf"], kv.xfer_buckets[op]):
                cumulative += n
                buckets.append((le, cumulative))
            xfer.add_metric([*values, op], buckets, kv.xfer_sum[op])
        blocks = CounterMetricFamily(
            f"{p}:kv_transfer_blocks", "Prefill side: KV blocks offered, pulled, expired.", labels=[*labels, "event"]
        )
        for event, n in (("offered", kv.blocks_offered), ("pulled", kv.blocks_pulled), ("expired", kv.blocks_expired)):
            blocks.add_metric([*values, event], n)
        failed = CounterMetricFamily(
            f"{p}:kv_transfer_num_failed_transfers",
            "Decode side: loads that failed (prompt recomputed).",
            labels=labels,
        )
        failed.add_metric(values, kv.num_failed_transfers)
        held = GaugeMetricFamily(
            f"{p}:kv_transfer_offered_blocks", "KV blocks offered and not yet pulled.", labels=labels
        )
        held.add_metric(values, kv.blocks_held)
        queue = GaugeMetricFamily(
            f"{p}:kv_transfer_num_requests", "Sequences running or waiting on this role.", labels=[*labels, "queue"]
        )
        queue.add_metric([*values, "running"], s.num_running)
        queue.add_metric([*values, "waiting"], s.num_waiting)
        yield from (nbytes, xfer, blocks, failed, held, queue)
