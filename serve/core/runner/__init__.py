"""The model runner, one role a file: `sizing` (step buckets, KV pool size), `batch` (the persistent
batch of per-sequence rows), `inputs` (a SchedulerOutput turned into a step's padded arrays),
`device_step` (the jitted forward, sampling, verify, resample and decode loop), `inflight` (a
dispatched step and its results), `model_runner` (weights and pools placed, steps dispatched),
`warmup` (what warm-up compiles, from abstract arguments), `compile_pool` (the threads that compile
it) and `ready_shapes` (the compiled shapes, and the smallest one a batch fits)."""

from serve.core.runner.batch import SlotTable
from serve.core.runner.inflight import InFlight
from serve.core.runner.inputs import StepBatch, StepInputs
from serve.core.runner.model_runner import ModelRunner
from serve.core.runner.sizing import buckets, fit, num_blocks_for_memory

__all__ = ["InFlight", "ModelRunner", "SlotTable", "StepBatch", "StepInputs", "buckets", "fit", "num_blocks_for_memory"]
