"""`--metrics-prefix vllm`: every series carries vLLM's exact name, so its dashboards and alerts match."""

import pytest

from serve.metrics import ServerMetrics

# Series that vLLM's example Grafana dashboard and its alert examples query (counters without _total).
VLLM_SERIES = {
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
}


def test_vllm_prefix_names_every_series_as_vllm_does():
    metrics = ServerMetrics("m", prefix="vllm")
    types = {family.name: family.type for family in metrics.registry.collect()}
    assert {name: types.get(name) for name in VLLM_SERIES} == VLLM_SERIES
    assert all(name.startswith("vllm:") for name in types)
    assert "jaxinfra:num_requests_running" in ServerMetrics("m").render().decode()


def test_a_prefix_that_is_not_a_prometheus_name_is_refused():
    with pytest.raises(ValueError, match="metrics prefix"):
        ServerMetrics("m", prefix="vllm:x")
