"""`--metrics-prefix vllm`: every series carries vLLM's exact name, so its dashboards and alerts match."""

import pytest

from serve.engine.output_processor import RequestIteration
from serve.http.metrics import ServerMetrics
from serve.sampling_params import SamplingParams
from serve.types import RequestMetrics, SchedulerStats

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


def test_vllm_prefix_also_exports_vllm_07_names_with_the_same_values():
    """Older Grafana dashboards query vllm:gpu_cache_usage_perc and vllm:time_per_output_token_seconds
    (vLLM 0.7); they carry what kv_cache_usage_perc and inter_token_latency_seconds carry."""
    metrics = ServerMetrics("m", prefix="vllm")
    stats = SchedulerStats(1, 0, 0.375, 0, 0, 0, 5, 8, 0)
    metrics.start_request("r", 4, SamplingParams(max_tokens=8))
    times = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=0.0)
    metrics.observe([RequestIteration("r", 1, times, True, None)], stats)
    for _ in range(3):
        metrics.observe([RequestIteration("r", 2, times, False, None)], stats)
    text = metrics.render().decode()

    def value(series: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(series + "{"))
        return float(line.rsplit(" ", 1)[1])

    assert value("vllm:gpu_cache_usage_perc") == value("vllm:kv_cache_usage_perc") == 0.375
    assert value("vllm:time_per_output_token_seconds_count") == value("vllm:inter_token_latency_seconds_count") == 6
    assert value("vllm:time_per_output_token_seconds_sum") == value("vllm:inter_token_latency_seconds_sum")
    assert "gpu_cache_usage_perc" not in ServerMetrics("m").render().decode()
