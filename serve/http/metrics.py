"""Prometheus metrics with vLLM's set and definitions, named `<prefix>:<name>` (`jaxinfra:` by default;
`vllm:` gives vLLM's exact names, for its Grafana dashboards and alert rules, and also exports vLLM
0.7's names for two renamed series, so dashboards built on them keep working)."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serve.core.expert_load import ExpertLoadMetrics
from serve.core.spec_decode.metrics import SpecDecodeCounters
from serve.engine.output_processor import RequestIteration
from serve.http.live_stats import LiveStats
from serve.kv_transfer.metrics import KVTransferMetrics
from serve.sampling_params import SamplingParams
from serve.types import SchedulerStats

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


TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
N_BUCKETS = (1, 2, 5, 10, 20)


@dataclasses.dataclass
class _Tracked:
    """A request in flight, as the metrics see it."""

    tenant: str
    tokens: Any  # its tenant's generation-token counter and ITL histograms: labels() resolved once, not per token
    itl: tuple[Any, ...]
    generated: int = 0
    last_token: float | None = None


class ServerMetrics:
    """Fed by the frontend after each batch of core outputs; rendered by GET /metrics. Request-level
    series carry a `tenant` label (empty without --api-keys-file); `live` keeps what /status shows."""

    def __init__(self, model_name: str, prefix: str = "jaxinfra") -> None:
        self.check_prefix(prefix)
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        per_request = ["model_name", "tenant"]
        r = self.registry

        def hist(name: str, doc: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, per_request, registry=r, buckets=buckets)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{prefix}:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str, label_names: list[str] = labels) -> Counter:
            return Counter(f"{prefix}:{name}", doc, label_names, registry=r)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        legacy = prefix == "vllm"  # vLLM 0.7's names for the same series
        self.kv_usage_v0 = gauge("gpu_cache_usage_perc", "kv_cache_usage_perc, vLLM 0.7's name.") if legacy else None
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (their KV freed, recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens received.", per_request)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.", per_request)
        self.success = counter(
            "request_success", "Finished requests, by finish reason.", [*per_request, "finished_reason"]
        )
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens of a request.")
        self.itl_v0 = (
            hist("time_per_output_token_seconds", "inter_token_latency_seconds under vLLM 0.7's name.")
            if legacy
            else None
        )
        self.tpot = hist(
            "request_time_per_output_token_seconds", "A request's mean time per output token after the first."
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first output token.")
        self.decode = hist("request_decode_time_seconds", "First output token to finish.")
        self.inference = hist("request_inference_time_seconds", "First scheduled to finish.")
        self.prompt_len = hist("request_prompt_tokens", "Prompt length of each request, in tokens.", TOKEN_BUCKETS)
        self.generation_len = hist(
            "request_generation_tokens", "Tokens generated for each request (all its sequences).", TOKEN_BUCKETS
        )
        self.max_tokens = hist("request_params_max_tokens", "Each request's max_tokens.", TOKEN_BUCKETS)
        self.params_n = hist("request_params_n", "Each request's n (sequences per prompt).", N_BUCKETS)
        self.spec_decode = SpecDecodeCounters(r, prefix, model_name)
        self.kv_transfer = KVTransferMetrics(r, prefix, model_name)
        self.expert_load = ExpertLoadMetrics(r, prefix, model_name)
        self.model_name = model_name
        self.live = LiveStats()
        self._seen = {"queries": 0, "hits": 0, "preemptions": 0}
        self._requests: dict[str, _Tracked] = {}

    @staticmethod
    def check_prefix(prefix: str) -> None:
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", prefix):
            raise ValueError(f"metrics prefix must be a Prometheus name (letters, digits, _), got {prefix!r}")

    def start_request(self, request_id: str, prompt_tokens: int, params: SamplingParams, tenant: str = "") -> None:
        """An engine request was admitted: its prompt and parameters are counted under its tenant."""
        self._requests[request_id] = self._track(tenant)
        self.prompt_tokens.labels(self.model_name, tenant).inc(prompt_tokens)
        self.prompt_len.labels(self.model_name, tenant).observe(prompt_tokens)
        self.params_n.labels(self.model_name, tenant).observe(params.n)
        if params.max_tokens is not None:
            self.max_tokens.labels(self.model_name, tenant).observe(params.max_tokens)
        self.live.start(request_id, prompt_tokens, tenant)

    def _track(self, tenant: str) -> _Tracked:
        labels = (self.model_name, tenant)
        itl = tuple(h.labels(*labels) for h in (self.itl, self.itl_v0) if h is not None)
        return _Tracked(tenant, self.generation_tokens.labels(*labels), itl)

    def finish_request(self, request_id: str) -> None:
        """The HTTP call is over: forget the request even if the core never reported its end."""
        self._requests.pop(request_id, None)
        self.live.finish(request_id)

    def observe(self, iterations: list[RequestIteration], stats: SchedulerStats | None) -> None:
        now = time.monotonic()
        if stats is not None:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.kv_usage.set(stats.kv_cache_usage)
            if self.kv_usage_v0 is not None:
                self.kv_usage_v0.set(stats.kv_cache_usage)
            for key, value, metric in (
                ("queries", stats.prefix_cache_queries, self.prefix_queries),
                ("hits", stats.prefix_cache_hits, self.prefix_hits),
                ("preemptions", stats.num_preemptions, self.preemptions),
            ):
                if value < self._seen[key]:  # a restarted core counts from zero again
                    self._seen[key] = 0
                metric.labels(self.model_name).inc(value - self._seen[key])
                self._seen[key] = value
            if stats.spec_decoding is not None:
                self.spec_decode.observe(stats.spec_decoding)
            self.kv_transfer.observe(stats)
            if stats.expert_load is not None:
                self.expert_load.observe(stats.expert_load)
        for it in iterations:
            m = it.metrics
            req = self._requests.get(it.request_id) or self._track("")
            tenant = (self.model_name, req.tenant)
            req.tokens.inc(it.new_tokens)
            req.generated += it.new_tokens
            if it.first_tokens and m.first_token_time is not None:
                self.ttft.labels(*tenant).observe(m.first_token_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.queue.labels(*tenant).observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
                    self.prefill.labels(*tenant).observe(max(m.first_token_time - m.first_scheduled_time, 0.0))
            elif it.new_tokens and req.last_token is not None:
                gap = (now - req.last_token) / it.new_tokens
                for _ in range(it.new_tokens):
                    for h in req.itl:
                        h.observe(gap)
            if it.new_tokens:
                req.last_token = now
            if it.finish_reason is not None:
                self._requests.pop(it.request_id, None)
                self.e2e.labels(*tenant).observe(now - m.arrival_time)
                self.success.labels(*tenant, it.finish_reason).inc()
                self.generation_len.labels(*tenant).observe(req.generated)
                if m.first_token_time is not None:
                    self.decode.labels(*tenant).observe(now - m.first_token_time)
                    if req.generated > 1:
                        self.tpot.labels(*tenant).observe((now - m.first_token_time) / (req.generated - 1))
                if m.first_scheduled_time is not None:
                    self.inference.labels(*tenant).observe(now - m.first_scheduled_time)
        self.live.observe(iterations, stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)
