"""Device memory as the engine sizes its KV pool on a GPU, with fake allocator statistics: what XLA
hands out, the utilization's share, weights, a step's activation peak and XLA's scratch margin; a
model that does not fit is one error naming them; the engine and plan-serve agree."""

import jax
import pytest

from jaxinfra.loading import load_config
from jaxinfra.workload import Workload
from serve.config import EngineArgs
from serve.core.kv_budget import (
    XLA_SCRATCH_SHARE,
    DeviceMemory,
    kv_pool_bytes,
    step_token_budget,
    step_workspace_bytes,
)
from serve.core.layout import blocks_from_memory
from serve.core.runner.sizing import kv_block_bytes
from serve.plan_serve import Device, plan

GIB = 2**30
H200 = 143771 * 2**20


def test_device_memory_comes_from_the_allocators_limit_and_fraction() -> None:
    stats = {"bytes_limit": int(H200 * 0.9), "bytes_in_use": 3 * GIB, "peak_bytes_in_use": 4 * GIB}
    memory = DeviceMemory.from_stats(stats, 0.9)
    assert memory.limit == int(H200 * 0.9)
    assert abs(memory.total - H200) <= 1
    assert memory.in_use == 3 * GIB


@pytest.mark.parametrize("stats", [None, {}, {"bytes_in_use": 5}])
def test_a_device_without_a_limit_asks_for_kv_cache_memory(stats, monkeypatch) -> None:
    """The platform allocator reports no limit (or no statistics): the size of the device is unknown."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    with pytest.raises(ValueError, match=r"'platform'.*kv_cache_memory"):
        DeviceMemory.from_stats(stats, 0.9)


def test_the_pool_is_what_the_utilization_leaves_after_weights_activations_and_scratch() -> None:
    memory = DeviceMemory(total=100 * GIB, limit=90 * GIB)
    ceiling = 90 * GIB
    left = kv_pool_bytes(memory, 0.9, weights=16 * GIB, activations=GIB)
    assert left == ceiling - 16 * GIB - GIB - int(ceiling * XLA_SCRATCH_SHARE)


@pytest.mark.parametrize(
    "fraction,utilization,ceiling",
    [
        (0.5, 0.9, 50 * GIB),  # the user gave XLA less than the utilization: what XLA hands out bounds it
        (0.95, 0.8, 80 * GIB),  # XLA may hand out more: the utilization bounds it
        (0.75, 0.75, 75 * GIB),  # a notebook: XLA's default fraction
    ],
)
def test_the_ceiling_is_the_smaller_of_the_utilization_and_the_allocators_limit(fraction, utilization, ceiling):
    memory = DeviceMemory.from_stats({"bytes_limit": int(100 * GIB * fraction)}, fraction)
    left = kv_pool_bytes(memory, utilization, weights=0, activations=0)
    assert abs(left - int(ceiling * (1 - XLA_SCRATCH_SHARE))) <= 2


def test_a_model_that_does_not_fit_is_one_error_naming_weights_activations_and_memory() -> None:
    memory = DeviceMemory(total=24 * GIB, limit=int(24 * GIB * 0.9))
    with pytest.raises(ValueError) as e:
        kv_pool_bytes(memory, 0.9, weights=21 * GIB, activations=GIB // 2)
    text = str(e.value)
    for part in ("21.0 GiB of weights", "activation peak of 512.0 MiB", "21.6 GiB available", "XLA's workspaces"):
        assert part in text


class FakeGpu:
    """A GPU as jax.devices() shows it, with allocator statistics."""

    platform = "gpu"

    def __init__(self, stats: dict | None) -> None:
        self.stats = stats

    def memory_stats(self) -> dict | None:
        return self.stats


def test_the_engine_sizes_from_device_statistics_and_agrees_with_plan_serve(monkeypatch) -> None:
    """On a (fake) 16 GiB GPU at XLA fraction 0.9 holding 1 GiB of weights, the engine's block count is
    plan-serve's, and pool + weights + activations leave XLA's scratch margin free in the allocator's
    limit (the pool used to fill the limit to its last byte)."""
    cfg = load_config("llama-3.2-1b")
    args = EngineArgs(model="llama-3.2-1b", max_model_len=4096, kv_cache_memory=None)
    weights = GIB
    limit = int(16 * GIB * 0.9)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    monkeypatch.setattr(jax, "devices", lambda *a: [FakeGpu({"bytes_limit": limit, "bytes_in_use": weights})])
    step_tokens = step_token_budget(args, 4096)
    blocks = blocks_from_memory(cfg, args, step_tokens)
    planned = plan(
        "llama-3.2-1b",
        cfg,
        args,
        Device("fake", 16 * GIB, 0.9),
        Workload.from_percentiles((512, 512), (128, 128)),
        weights,
    )
    assert blocks == planned.num_blocks > 0
    activations = step_workspace_bytes(cfg, step_tokens, args.max_num_seqs)
    used = blocks * kv_block_bytes(cfg, args.block_size, args.kv_cache_dtype) + weights + activations
    assert used <= limit * (1 - XLA_SCRATCH_SHARE)
    assert used > limit * (1 - XLA_SCRATCH_SHARE) - kv_block_bytes(cfg, args.block_size, "auto")


def test_the_engine_refuses_a_model_that_does_not_fit_at_start(monkeypatch) -> None:
    cfg = load_config("llama-3.2-1b")
    args = EngineArgs(model="llama-3.2-1b", max_model_len=4096)
    stats = {"bytes_limit": int(4 * GIB * 0.9), "bytes_in_use": int(3.5 * GIB)}
    monkeypatch.setattr(jax, "devices", lambda *a: [FakeGpu(stats)])
    with pytest.raises(ValueError, match="does not fit on the device"):
        blocks_from_memory(cfg, args, step_token_budget(args, 4096))


ONE_COPY = """
import gc, jax
from jaxinfra.loading import DEFAULT_MODEL
from serve import LLM
llm = LLM(str(DEFAULT_MODEL), max_model_len=256, max_num_seqs=4)
gc.collect()
runner = llm.engine.core.runner
held = sum(a.nbytes for a in runner.weights) + sum(a.nbytes for a in jax.tree.leaves(runner.kv_cache))
print(sum(a.nbytes for a in jax.live_arrays()) - held, sum(a.nbytes for a in runner.weights))
"""


def test_a_serving_engine_holds_its_weights_once():
    """With scanned layers the steps read stacked weights; the per-layer arrays they were stacked from
    used to stay alive beside them (a second copy of every layer the KV sizing never counted)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", ONE_COPY], capture_output=True, text=True, check=True).stdout
    extra, weights = map(int, out.split()[-2:])
    assert 0 <= extra < weights // 100, (extra, weights)
