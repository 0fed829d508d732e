"""Cumulative KV transfer counters an engine core keeps (sent to the frontend with its stats)."""

from __future__ import annotations

import bisect
import dataclasses

XFER_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
OPS = ("save", "load")  # save: a prefill engine's blocks out to the transport; load: a decode engine's in


@dataclasses.dataclass
class KVTransferStats:
    """Since the core started: bytes and a latency histogram per op, blocks offered/pulled/expired
    (prefill side), loads that failed (decode side, recomputed instead), requests loading now."""

    role: str
    bytes: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(OPS, 0))
    xfer_count: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(OPS, 0))
    xfer_sum: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(OPS, 0.0))
    xfer_buckets: dict[str, list[int]] = dataclasses.field(
        default_factory=lambda: {op: [0] * (len(XFER_TIME_BUCKETS) + 1) for op in OPS}
    )
    blocks_offered: int = 0
    blocks_pulled: int = 0
    blocks_expired: int = 0
    blocks_held: int = 0
    num_failed_transfers: int = 0

    def observe(self, op: str, seconds: float, nbytes: int) -> None:
        """One transfer of one request's blocks."""
        self.bytes[op] += nbytes
        self.xfer_count[op] += 1
        self.xfer_sum[op] += seconds
        self.xfer_buckets[op][bisect.bisect_left(XFER_TIME_BUCKETS, seconds)] += 1
