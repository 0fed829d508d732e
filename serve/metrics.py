"""Prometheus metrics with vLLM's set and definitions (names under the `jaxinfra:` prefix)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serve.engine import LLMEngine
from serve.outputs import RequestOutput

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class ServerMetrics:
    """Updated by the engine thread after each step; rendered by GET /metrics."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"jaxinfra:{name}", doc, labels, registry=r, buckets=LATENCY_BUCKETS).labels(model_name)

        self.running = Gauge("jaxinfra:num_requests_running", "Requests in the running batch.", labels,
                             registry=r).labels(model_name)
        self.waiting = Gauge("jaxinfra:num_requests_waiting", "Requests waiting to be scheduled.", labels,
                             registry=r).labels(model_name)
        self.kv_usage = Gauge("jaxinfra:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                              labels, registry=r).labels(model_name)
        self.prefix_queries = Counter("jaxinfra:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels, registry=r).labels(model_name)
        self.prefix_hits = Counter("jaxinfra:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   labels, registry=r).labels(model_name)
        self.prompt_tokens = Counter("jaxinfra:prompt_tokens", "Prompt tokens received.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("jaxinfra:generation_tokens", "Tokens generated.", labels,
                                         registry=r).labels(model_name)
        self.success = Counter("jaxinfra:request_success", "Finished requests, by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens of a request.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.")
        self.model_name = model_name
        self._seen = {"prompt": 0, "generation": 0, "queries": 0, "hits": 0}
        self._finished_seen: dict[str, int] = {}
        self._last_token: dict[str, tuple[float, int]] = {}

    def observe(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        bm = engine.block_manager
        self.kv_usage.set(bm.usage)
        c = engine.counters
        for key, value, metric in (("prompt", c.prompt_tokens, self.prompt_tokens),
                                   ("generation", c.generation_tokens, self.generation_tokens),
                                   ("queries", bm.prefix_queries, self.prefix_queries),
                                   ("hits", bm.prefix_hits, self.prefix_hits)):
            metric.inc(value - self._seen[key])
            self._seen[key] = value
        for out in outputs:
            m = out.metrics
            produced = sum(len(o.token_ids) for o in out.outputs)
            last = self._last_token.get(out.request_id)
            if last is None and produced and m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.queue.observe(m.first_scheduled_time - m.arrival_time)
            elif last is not None and produced > last[1]:
                gap = (now - last[0]) / (produced - last[1])
                for _ in range(produced - last[1]):
                    self.itl.observe(gap)
            self._last_token[out.request_id] = (now, produced)
            if out.finished:
                self._last_token.pop(out.request_id, None)
                self.e2e.observe(now - m.arrival_time)
        for reason, count in c.finished.items():
            self.success.labels(self.model_name, reason).inc(count - self._finished_seen.get(reason, 0))
            self._finished_seen[reason] = count

    def forget(self, request_id: str) -> None:
        """Drop per-request state of an aborted request."""
        self._last_token.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)
