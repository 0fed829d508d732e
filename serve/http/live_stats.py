"""What /status and /dashboard show over time: sliding windows of TTFT and ITL samples, token
rates, a once-a-second history of the scheduler's gauges, and the requests in flight.

Fed by the same hook as the Prometheus metrics (ServerMetrics forwards to it); everything here is
bounded (a window of seconds, a history of points, one entry per request in flight).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from serve.engine.output_processor import RequestIteration
from serve.types import SchedulerStats

PERCENTILES = (50, 90, 95, 99)


@dataclasses.dataclass
class _InFlight:
    arrival: float  # time.monotonic
    prompt_tokens: int
    tenant: str
    first_token: float | None = None
    last_token: float | None = None
    generated: int = 0


class LiveStats:
    """Sliding windows (`window_s` seconds) of latencies and token counts, and `history` points of
    one per second: running, waiting, KV usage, prefix-cache hit rate, tokens/s in and out."""

    def __init__(self, window_s: float = 60.0, history: int = 300, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.ttft: deque[tuple[float, float]] = deque()
        self.itl: deque[tuple[float, float]] = deque()
        self.tokens_in: deque[tuple[float, int]] = deque()
        self.tokens_out: deque[tuple[float, int]] = deque()
        self.points: deque[dict[str, float]] = deque(maxlen=history)
        self.requests: dict[str, _InFlight] = {}
        self.stats: SchedulerStats | None = None
        self._last_sample: tuple[float, int, int, int, int] | None = None  # time, queries, hits, in, out
        self.total_in = self.total_out = 0

    def start(self, request_id: str, prompt_tokens: int, tenant: str) -> None:
        self.requests[request_id] = _InFlight(self.clock(), prompt_tokens, tenant)

    def finish(self, request_id: str) -> None:
        """The request left (finished, aborted or refused); unknown ids are ignored."""
        self.requests.pop(request_id, None)

    def observe(self, iterations: list[RequestIteration], stats: SchedulerStats | None) -> None:
        now = self.clock()
        if stats is not None:
            self.stats = stats
        for it in iterations:
            r = self.requests.get(it.request_id)
            if it.first_tokens and it.metrics.first_token_time is not None:
                self.ttft.append((now, it.metrics.first_token_time - it.metrics.arrival_time))
                if r is not None:
                    r.first_token = now
                    self.tokens_in.append((now, r.prompt_tokens))
                    self.total_in += r.prompt_tokens
            elif it.new_tokens and r is not None and r.last_token is not None:
                self.itl.extend([(now, (now - r.last_token) / it.new_tokens)] * it.new_tokens)
            if it.new_tokens:
                self.tokens_out.append((now, it.new_tokens))
                self.total_out += it.new_tokens
                if r is not None:
                    r.last_token = now
                    r.generated += it.new_tokens
            if it.finish_reason is not None:
                self.finish(it.request_id)
        self._sample(now)

    def _expire(self, now: float) -> None:
        for window in (self.ttft, self.itl, self.tokens_in, self.tokens_out):
            while window and window[0][0] < now - self.window_s:
                window.popleft()

    def _sample(self, now: float) -> None:
        """One history point per second at most: gauges now, rates since the previous point."""
        last = self._last_sample
        if last is not None and now - last[0] < 1.0:
            return
        s = self.stats
        queries, hits = (s.prefix_cache_queries, s.prefix_cache_hits) if s else (0, 0)
        if last is not None:
            dt = now - last[0]
            dq, dh = max(queries - last[1], 0), max(hits - last[2], 0)
            self.points.append(
                {
                    "t": round(now, 3),
                    "running": s.num_running if s else 0,
                    "waiting": s.num_waiting if s else 0,
                    "kv_usage": s.kv_cache_usage if s else 0.0,
                    "prefix_hit_rate": dh / dq if dq else 0.0,
                    "tokens_in_per_s": (self.total_in - last[3]) / dt,
                    "tokens_out_per_s": (self.total_out - last[4]) / dt,
                }
            )
        self._last_sample = (now, queries, hits, self.total_in, self.total_out)

    def snapshot(self, slowest: int = 10, stats: SchedulerStats | None = None) -> dict[str, Any]:
        """The windows' percentiles and rates, the history, and the `slowest` requests in flight;
        `stats`: the core's gauges now (default: the last ones it sent with outputs)."""
        now = self.clock()
        self.stats = stats or self.stats
        self._sample(now)
        self._expire(now)

        def pct(window: deque[tuple[float, float]]) -> dict[str, float | None]:
            values = np.array([v for _, v in window])
            return {f"p{p}": float(np.percentile(values, p)) if values.size else None for p in PERCENTILES}

        span = min(self.window_s, max(now - (self.points[0]["t"] if self.points else now), 1.0))
        oldest = sorted(self.requests.items(), key=lambda kv: kv[1].arrival)[:slowest]
        s = self.stats
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s and s.prefix_cache_queries else 0.0
        return {
            "window_s": self.window_s,
            "ttft_s": pct(self.ttft),
            "itl_s": pct(self.itl),
            "tokens_in_per_s": sum(n for _, n in self.tokens_in) / span,
            "tokens_out_per_s": sum(n for _, n in self.tokens_out) / span,
            "total_prompt_tokens": self.total_in,
            "total_generation_tokens": self.total_out,
            "running": s.num_running if s else 0,
            "waiting": s.num_waiting if s else 0,
            "kv_usage": s.kv_cache_usage if s else 0.0,
            "prefix_cache_hit_rate": hit_rate,
            "preemptions": s.num_preemptions if s else 0,
            "expert_load": s.expert_load.summary() if s and s.expert_load else None,
            "step_shapes": {"compiled": s.shapes_compiled, "total": s.shapes_total} if s else None,
            "history": list(self.points),
            "slowest_requests": [
                {
                    "request_id": rid,
                    "tenant": r.tenant,
                    "age_s": round(now - r.arrival, 3),
                    "prompt_tokens": r.prompt_tokens,
                    "generated_tokens": r.generated,
                    "ttft_s": None if r.first_token is None else round(r.first_token - r.arrival, 3),
                }
                for rid, r in oldest
            ],
        }
