"""Prometheus metrics with vLLM's set and definitions (names under the `jaxinfra:` prefix)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serve.core_types import SchedulerStats
from serve.output_processor import RequestIteration

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class ServerMetrics:
    """Fed by the frontend after each batch of core outputs; rendered by GET /metrics."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"jaxinfra:{name}", doc, labels, registry=r, buckets=LATENCY_BUCKETS).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"jaxinfra:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"jaxinfra:{name}", doc, labels, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (their KV freed, recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens received.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.success = Counter(
            "jaxinfra:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens of a request.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.")
        self.model_name = model_name
        self._seen = {"queries": 0, "hits": 0, "preemptions": 0}
        self._last_token: dict[str, float] = {}

    def observe_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens.inc(num_tokens)

    def observe(self, iterations: list[RequestIteration], stats: SchedulerStats | None) -> None:
        now = time.monotonic()
        if stats is not None:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.kv_usage.set(stats.kv_cache_usage)
            for key, value, metric in (
                ("queries", stats.prefix_cache_queries, self.prefix_queries),
                ("hits", stats.prefix_cache_hits, self.prefix_hits),
                ("preemptions", stats.num_preemptions, self.preemptions),
            ):
                if value < self._seen[key]:  # a restarted core counts from zero again
                    self._seen[key] = 0
                metric.inc(value - self._seen[key])
                self._seen[key] = value
        for it in iterations:
            m = it.metrics
            self.generation_tokens.inc(it.new_tokens)
            if it.first_tokens and m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.queue.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
            elif it.new_tokens:
                last = self._last_token.get(it.request_id, now)
                gap = (now - last) / it.new_tokens
                for _ in range(it.new_tokens):
                    self.itl.observe(gap)
            if it.new_tokens:
                self._last_token[it.request_id] = now
            if it.finish_reason is not None:
                self._last_token.pop(it.request_id, None)
                self.e2e.observe(now - m.arrival_time)
                self.success.labels(self.model_name, it.finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
