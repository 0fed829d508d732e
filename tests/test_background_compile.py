"""A background warm-up: the engine answers once the largest shape of each kind is compiled, batches
padding to compiled shapes, with the outputs of a fully warmed engine; once the rest have compiled,
nothing compiles again (not even in XLA: the abstract compilations fill the jitted calls' caches)."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from jax import monitoring

import serve.core.runner.warmup
from serve import SamplingParams
from serve.config import EngineArgs
from serve.core.runner.warmup import ordered, shape_groups
from tests.serve_helpers import GREEDY, engine, prompts, reference, run

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_scheduler_steps=4)
PENALIZED = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
backend_compiles = [0]


def _count(event: str, _duration: float, **_: object) -> None:
    if event == BACKEND_COMPILE:
        backend_compiles[0] += 1


monitoring.register_event_duration_secs_listener(_count)


def outputs(eng, ps):
    """Greedy outputs of `ps` (every other one with a repetition penalty: the resampler) arriving
    over a few steps."""
    arrivals = {i: [(f"r{i}", p, GREEDY if i % 2 else PENALIZED)] for i, p in enumerate(ps)}
    done = run(eng, arrivals)
    return [done[f"r{i}"].outputs[0].token_ids for i in range(len(ps))]


def test_serves_before_every_shape_is_compiled_with_a_warm_engines_outputs(monkeypatch):
    release = threading.Event()
    held = serve.core.runner.warmup.compile_job

    def gated(runner, shape, state):  # shapes after the first ones wait until released
        job = held(runner, shape, state)
        if shape in ordered(shape_groups(runner))[0]:
            return job
        return lambda: (release.wait(), job())

    monkeypatch.setattr(serve.core.runner.warmup, "compile_job", gated)
    eng = engine(**SMALL)
    runner = eng.core.runner
    runner.warmup(background=True, threads=2)
    first, rest = ordered(shape_groups(runner))
    assert {s.kind for s in first} == {"step", "loop", "resample"} and rest
    traced = runner.num_compilations
    ps = prompts((5, 40, 17, 3, 60, 9), seed=11)
    early = outputs(eng, ps)
    assert set(first) == set(runner.ready) and not runner.ready.complete  # only the first ones, all used
    assert runner.num_compilations == traced  # every batch padded to a compiled shape
    assert runner.shapes_compiled == (len(first), len(first) + len(rest))
    release.set()
    runner.wait_compiled()
    assert runner.ready.complete and runner.shapes_compiled == (len(first) + len(rest),) * 2
    compiled = backend_compiles[0]
    assert outputs(eng, ps) == early
    assert backend_compiles[0] == compiled
    greedy = [ids for i, ids in enumerate(early) if i % 2]
    assert greedy == reference([p for i, p in enumerate(ps) if i % 2], GREEDY.max_tokens)


def test_a_failed_compilation_is_raised_by_wait_compiled(monkeypatch):
    held = serve.core.runner.warmup.compile_job

    def failing(runner, shape, state):
        job = held(runner, shape, state)
        return job if shape in ordered(shape_groups(runner))[0] else lambda: 1 / 0

    monkeypatch.setattr(serve.core.runner.warmup, "compile_job", failing)
    runner = engine(**{**SMALL, "num_scheduler_steps": 1}).core.runner
    runner.warmup(background=True, threads=1)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        runner.wait_compiled()
    assert not runner.ready.complete


TENSOR_PARALLEL = """
from jax import monitoring
compiles = [0]
event = "/jax/core/compile/backend_compile_duration"
monitoring.register_event_duration_secs_listener(lambda e, _s, **_: compiles.__setitem__(0, compiles[0] + (e == event)))
from tests.serve_helpers import GREEDY, engine, prompts, run
eng = engine(tensor_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
eng.core.runner.warmup()
before = compiles[0]
run(eng, {0: [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts([5, 40, 17], seed=2))]})
print("compiled after warm-up:", compiles[0] - before)
"""


def test_tensor_parallel_steps_compile_nothing_after_warm_up():
    """Sharded arguments: the abstract compilations are the calls' own (the first step's previous
    tokens too, placed as the steps place theirs), on two CPU devices."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", TENSOR_PARALLEL], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert "compiled after warm-up: 0" in out.stdout, out.stdout + out.stderr[-2000:]


def test_compile_threads_must_not_be_negative():
    with pytest.raises(ValueError, match="compile_threads"):
        EngineArgs(compile_threads=-1)
