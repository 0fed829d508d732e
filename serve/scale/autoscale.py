"""SLO autoscaling policy: recent serving metrics -> a target replica count.

Scale on the SLO (P95 time to first token, P95 inter-token latency, queued requests, KV-cache
pressure), not on GPU utilization, which hides long-tail TTFT. The policy is a pure function:

    target = target_replicas(samples, current_replicas, config, last_change)

`samples` are `MetricsSample`s, oldest first, each the whole deployment's numbers at one moment
(P95s over a short sliding window, as `histogram_quantile(0.95, rate(..._bucket[1m]))` gives; the
queue summed over replicas; KV usage averaged). Only samples taken since `last_change` (the time
replicas last changed) count, so every decision waits a full delay window at the current size.

- **Up**: when *every* sample of the last `upscale_delay_s` is overloaded (any SLO signal above its
  target), to `ceil(current x r)` replicas, r the smallest over that window of the worst signal's
  ratio to its target (what was sustained, not the peak), at least one more.
- **Down**: when every sample of the last `downscale_delay_s` is quiet (every signal below
  `downscale_fraction` of its target, nothing waiting), one replica fewer.
- **Hysteresis**: between quiet and overloaded nothing changes; a spike shorter than the delay
  changes nothing; the result stays within [min_replicas, max_replicas].

`SloAutoscaler` keeps the window and the last change for a caller that polls (a Ray Serve custom
policy, a KEDA external scaler): `observe(sample)` each poll, then `decide(current)`. On
Kubernetes, configs/deploy/k8s/keda-scaledobject.yaml applies the same TTFT rule through KEDA.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class AutoscaleConfig:
    """Targets (seconds, fractions, requests per replica), delays (seconds) and bounds."""

    min_replicas: int = 1
    max_replicas: int = 8
    ttft_p95_target_s: float = 0.45
    itl_p95_target_s: float = 0.1
    waiting_per_replica_target: float = 8.0
    kv_usage_target: float = 0.95  # counts only while requests wait: a full cache with no queue is fine
    downscale_fraction: float = 0.5  # quiet = every signal below this fraction of its target
    upscale_delay_s: float = 120.0
    downscale_delay_s: float = 600.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"AutoscaleConfig.min_replicas ({self.min_replicas}) must be >= 1 and <= max_replicas "
                f"({self.max_replicas})"
            )
        for name in ("ttft_p95_target_s", "itl_p95_target_s", "waiting_per_replica_target", "kv_usage_target"):
            if not getattr(self, name) > 0:
                raise ValueError(f"AutoscaleConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.downscale_fraction < 1:
            raise ValueError(f"AutoscaleConfig.downscale_fraction must be in (0, 1), got {self.downscale_fraction!r}")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"AutoscaleConfig.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class MetricsSample:
    """The deployment at `time` (seconds): P95s in seconds (None: no request in the window), requests
    waiting in all replicas' queues, mean KV-cache usage (0-1)."""

    time: float
    ttft_p95: float | None = None
    itl_p95: float | None = None
    num_waiting: float = 0.0
    kv_usage: float = 0.0


def load_ratio(sample: MetricsSample, replicas: int, config: AutoscaleConfig) -> float:
    """The worst SLO signal's ratio to its target (> 1: overloaded)."""
    ratios = [
        (sample.ttft_p95 or 0.0) / config.ttft_p95_target_s,
        (sample.itl_p95 or 0.0) / config.itl_p95_target_s,
        sample.num_waiting / replicas / config.waiting_per_replica_target,
        sample.kv_usage / config.kv_usage_target if sample.num_waiting > 0 else 0.0,
    ]
    return max(ratios)


def _window(samples: Sequence[MetricsSample], now: float, delay: float) -> list[MetricsSample] | None:
    """The samples of the last `delay` seconds, or None when they do not cover that long."""
    if not samples or now - samples[0].time < delay:
        return None
    return [s for s in samples if s.time >= now - delay]


def target_replicas(
    samples: Sequence[MetricsSample],
    current_replicas: int,
    config: AutoscaleConfig,
    last_change: float = -math.inf,
) -> int:
    """The replica count the deployment should have (see the module docstring for the rules)."""
    current = min(max(current_replicas, config.min_replicas), config.max_replicas)
    recent = [s for s in samples if s.time >= last_change]
    if not recent:
        return current
    now = recent[-1].time
    up = _window(recent, now, config.upscale_delay_s)
    if up:
        sustained = min(load_ratio(s, current, config) for s in up)
        if sustained > 1:
            return min(max(current + 1, math.ceil(current * sustained)), config.max_replicas)
    down = _window(recent, now, config.downscale_delay_s)
    if down and all(load_ratio(s, current, config) < config.downscale_fraction and s.num_waiting == 0 for s in down):
        return max(current - 1, config.min_replicas)
    return current


class SloAutoscaler:
    """`target_replicas` for a caller that polls: keeps the samples the delays need and the time of
    the last change it decided."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self.samples: collections.deque[MetricsSample] = collections.deque()
        self.last_change = -math.inf

    def observe(self, sample: MetricsSample) -> None:
        self.samples.append(sample)
        horizon = sample.time - max(self.config.upscale_delay_s, self.config.downscale_delay_s)
        while len(self.samples) > 1 and self.samples[1].time <= horizon:
            self.samples.popleft()

    def decide(self, current_replicas: int) -> int:
        """The target for the deployment now (the latest sample's time); a change restarts the delays."""
        target = target_replicas(self.samples, current_replicas, self.config, self.last_change)
        if target != current_replicas and self.samples:
            self.last_change = self.samples[-1].time
        return target
