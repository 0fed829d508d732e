"""The SLO autoscaling policy on synthetic metric series sampled every 10 seconds."""

import random
from collections.abc import Callable

import pytest

from serve.scale.autoscale import AutoscaleConfig, MetricsSample, SloAutoscaler, target_replicas

CONFIG = AutoscaleConfig(min_replicas=1, max_replicas=6)  # TTFT P95 target 0.45 s; delays 120 s up, 600 s down
STEP = 10.0


def simulate(series: Callable[[float], MetricsSample], start: int, seconds: float) -> list[tuple[float, int]]:
    """Replica count after each poll: (time, replicas)."""
    return run(polls(series, seconds), start)


def polls(series: Callable[[float], MetricsSample], seconds: float) -> list[MetricsSample]:
    return [series(i * STEP) for i in range(int(seconds / STEP) + 1)]


def run(samples: list[MetricsSample], start: int) -> list[tuple[float, int]]:
    scaler, replicas, out = SloAutoscaler(CONFIG), start, []
    for sample in samples:
        scaler.observe(sample)
        replicas = scaler.decide(replicas)
        out.append((sample.time, replicas))
    return out


def first_change(trace: list[tuple[float, int]], start: int) -> tuple[float, int] | None:
    return next(((t, r) for t, r in trace if r != start), None)


def test_ttft_spike_scales_up_after_the_delay() -> None:
    def series(t: float) -> MetricsSample:
        return MetricsSample(t, ttft_p95=0.9 if t >= 300 else 0.3, itl_p95=0.03, num_waiting=2)

    trace = simulate(series, start=2, seconds=900)
    # overloaded from t=300: the first window of 120 s that is overloaded throughout ends at t=420;
    # TTFT at 2x its target doubles the replicas
    assert first_change(trace, 2) == (420.0, 4)
    # the next decision waits a full window at the new size: still overloaded, so up again at 540
    assert dict(trace)[530.0] == 4 and dict(trace)[540.0] == 6 and dict(trace)[900.0] == 6  # max_replicas


def test_noise_and_short_spikes_do_not_scale() -> None:
    rng = random.Random(0)
    spikes = {t for t in range(0, 3600, 10) if rng.random() < 0.05}  # ~5% of polls start a 30 s spike

    def series(t: float) -> MetricsSample:
        spiking = any(t - 30 < s <= t for s in spikes)
        return MetricsSample(
            t,
            ttft_p95=(1.2 if spiking else 0.3) * rng.uniform(0.8, 1.2),
            itl_p95=0.04 * rng.uniform(0.5, 1.5),
            num_waiting=rng.randint(0, 3),
            kv_usage=rng.uniform(0.5, 0.99),  # high at times, but the queue stays short
        )

    samples = polls(series, 3600)
    assert len(spikes) > 5
    assert max(s.ttft_p95 or 0 for s in samples) > 2 * CONFIG.ttft_p95_target_s  # the spikes are real
    assert {r for _, r in run(samples, 3)} == {3}


def test_quiet_period_scales_down_to_min_one_step_per_delay() -> None:
    def series(t: float) -> MetricsSample:
        return MetricsSample(t, ttft_p95=0.05, itl_p95=0.01, num_waiting=0, kv_usage=0.1)

    trace = dict(simulate(series, start=4, seconds=2400))
    assert trace[590.0] == 4 and trace[600.0] == 3
    assert trace[1190.0] == 3 and trace[1200.0] == 2
    assert trace[1800.0] == 1 and trace[2400.0] == 1  # min_replicas


def test_hysteresis_band_holds_and_idle_replicas_are_not_overload() -> None:
    band = [MetricsSample(t, ttft_p95=0.3, itl_p95=0.06) for t in range(0, 1300, 10)]  # between half and target
    assert target_replicas(band, 3, CONFIG) == 3
    no_traffic = [MetricsSample(t) for t in range(0, 1300, 10)]  # no requests: P95s are None
    assert target_replicas(no_traffic, 3, CONFIG) == 2


def test_kv_pressure_counts_only_with_a_queue() -> None:
    full_no_queue = [MetricsSample(t, ttft_p95=0.3, kv_usage=0.99) for t in range(0, 200, 10)]
    assert target_replicas(full_no_queue, 2, CONFIG) == 2
    full_queue = [MetricsSample(t, ttft_p95=0.3, kv_usage=0.99, num_waiting=1) for t in range(0, 200, 10)]
    assert target_replicas(full_queue, 2, CONFIG) == 3  # at least one more
    deep_queue = [MetricsSample(t, ttft_p95=0.3, num_waiting=40) for t in range(0, 200, 10)]
    assert target_replicas(deep_queue, 2, CONFIG) == 5  # 20 waiting per replica vs 8: ceil(2 x 2.5)


def test_bounds_delays_and_last_change() -> None:
    hot = [MetricsSample(t, ttft_p95=4.5) for t in range(0, 200, 10)]  # 10x the target
    assert target_replicas(hot, 2, CONFIG) == 6  # capped at max_replicas
    assert target_replicas(hot[:12], 2, CONFIG) == 2  # 110 s of history: shorter than the delay
    assert target_replicas(hot, 2, CONFIG, last_change=100) == 2  # only 90 s at the current size
    assert target_replicas([], 0, CONFIG) == 1  # below min_replicas: brought up to it
    assert target_replicas(hot, 9, CONFIG) == 6  # above max_replicas: brought down to it


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"min_replicas": 3, "max_replicas": 2}, "min_replicas"),
        ({"ttft_p95_target_s": 0}, "ttft_p95_target_s"),
        ({"downscale_fraction": 1.0}, "downscale_fraction"),
        ({"upscale_delay_s": -1}, "upscale_delay_s"),
    ],
)
def test_bad_config_names_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"AutoscaleConfig.{field}"):
        AutoscaleConfig(**changes)
