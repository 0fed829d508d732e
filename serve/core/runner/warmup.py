"""Warm-up: what the runner compiles before it serves, and how.

Every step shape is compiled ahead of its use from abstract arguments (`jit(f).lower(...).compile()`
on ShapeDtypeStructs: no batch runs, so compile threads never touch the KV pools the step loop donates,
and the jitted callables' own caches hold the result: a later call of that shape neither traces nor
compiles). The largest shape of each kind comes first (every batch fits one of them, padded); in the
background mode the runner serves from then on while the others compile on the pool's threads, and
each batch pads to the smallest compiled shape that holds it (serve.core.runner.ready_shapes).

A runner with a device proposer (serve.core.spec_decode.proposer) runs each shape once instead, as
warm-up always did: its proposer's jitted calls are made inside the step's dispatch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np
from tqdm import tqdm

from jaxinfra.config import ModelConfig
from serve.core.host_transfer import Layout, pack
from serve.core.runner.batch import SlotTable
from serve.core.runner.compile_pool import CompilePool, default_threads
from serve.core.runner.inflight import InFlight
from serve.core.runner.inputs import InputBuilder, StepBatch
from serve.core.runner.ready_shapes import ReadyShapes, Shape, resample_shape
from serve.core.spec_decode.verify_batch import verify_arrays
from serve.core.structured_output import bitmask_words

if TYPE_CHECKING:  # serve.core.layout imports this package (its sizing)
    from serve.core.layout import CoreLayout


class Runner(Protocol):
    """What warm-up reads of serve.core.runner.model_runner.ModelRunner (which imports this module)."""

    cfg: ModelConfig
    layout: CoreLayout
    slots: SlotTable
    inputs: InputBuilder
    ready: ReadyShapes
    kv_cache: Any
    prev_tokens: jax.Array
    _no_prev: jax.Array
    _step: Any  # the jitted calls
    _multi: Any
    _resample: Any
    _verify: Any

    @property
    def proposer(self) -> object | None: ...

    @property
    def step_weights(self) -> list: ...

    def shapes(self) -> list[tuple[int, int, int, int]]: ...

    def verify_shapes(self) -> list[tuple[int, int, int, int]]: ...

    def dummy(self, tb: int, sb: int, width: int, q: int, num_steps: int = 1) -> StepBatch: ...

    def dispatch(self, batch: StepBatch) -> InFlight: ...

    @staticmethod
    def _loop_buffers(batch: StepBatch) -> tuple[dict[str, np.ndarray], Layout]: ...


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs for a pytree of arrays, as the jitted call sees them: a committed array's
    sharding kept (an uncommitted one's left out, or the lowering would not be the call's)."""

    def one(x: Any) -> jax.ShapeDtypeStruct:
        if isinstance(x, jax.Array):
            sharding = x.sharding if x.committed else None
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.aval.weak_type)
        return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)

    return jax.tree.map(one, tree)


def shape_groups(runner: Runner) -> list[list[Shape]]:
    """Every shape warm-up compiles, in groups of one call and one query layout: decode steps, steps
    with a prompt chunk, decode loops (num_scheduler_steps > 1), resamplers, and verify steps with a
    prompt chunk and with k + 1 tokens a row (speculative decoding)."""
    steps = [Shape("step", *s) for s in runner.shapes()]
    loops = []
    if runner.layout.num_scheduler_steps > 1:
        loops = [Shape("loop", sb, sb, w, 1) for sb in runner.layout.seq_buckets for w in runner.layout.width_buckets]
    verify = [Shape("verify", *s) for s in runner.verify_shapes()]
    k1 = runner.layout.num_speculative_tokens + 1
    groups = [
        [s for s in steps if s.q == 1],
        [s for s in steps if s.q > 1],
        loops,
        [resample_shape(sb) for sb in runner.layout.seq_buckets],
        [s for s in verify if s.q != k1 or s.tokens != s.rows * k1],
        [s for s in verify if s.q == k1 and s.tokens == s.rows * k1],
    ]
    return [g for g in groups if g]


def ordered(groups: list[list[Shape]]) -> tuple[list[Shape], list[Shape]]:
    """The largest shape of each group (what serving needs first), then the rest, smallest first (what
    a lightly loaded server pads to least)."""
    size = lambda s: (s.tokens, s.rows, s.width)
    first = [max(g, key=size) for g in groups]
    rest = sorted((s for g in groups for s in g if s not in first), key=size)
    return first, rest


def compile_job(runner: Runner, shape: Shape, state: tuple[Any, Any, Any]) -> Callable[[], object]:
    """The call that compiles `shape` given the abstract (weights, KV pools, previous tokens); its
    other arguments are made here, on the calling thread (a dummy batch's columns come from the
    runner's persistent batch, which the step loop also uses)."""
    weights, kv, prev = state
    tokens, rows, width, q = shape[1:]
    if shape.kind == "loop":
        steps = runner.layout.num_scheduler_steps
        loop, loop_layout = runner._loop_buffers(runner.dummy(tokens, rows, width, q, steps))
        loop = abstract(loop)
        return lambda: runner._multi.lower(weights, kv, loop, prev, layout=loop_layout, num_steps=steps).compile()
    if shape.kind == "resample":
        step = runner.dummy(rows, rows, runner.layout.width_buckets[0], 1)
        step_buffers, step_layout = pack((step.inputs, step.sampling))
        step_buffers = abstract(step_buffers)
        bitmask = np.full((rows, bitmask_words(runner.cfg.vocab_size)), -1, np.int32)
        bias = runner.slots.bias(np.zeros(0, np.int32), rows)
        extra, extra_layout = pack((step.sampling, *runner.inputs.history([], rows), bitmask, *bias))
        extra = abstract(extra)

        def resample() -> None:  # its logits' dtype is the step's: traced (once) for it
            traced = runner._step.trace(weights, kv, step_buffers, prev, layout=step_layout, max_q_len=1)
            runner._resample.lower(traced.out_info[2], extra, layout=extra_layout).compile()

        return resample
    batch = runner.dummy(tokens, rows, width, q)
    if shape.kind == "verify":
        spec = verify_arrays(np.zeros((0, runner.layout.num_speculative_tokens), np.int32), np.zeros(0, np.int32), rows)
        verify, v_layout = pack((batch.inputs, batch.sampling, *spec))
        verify = abstract(verify)
        return lambda: runner._verify.lower(weights, kv, verify, prev, None, layout=v_layout, max_q_len=q).compile()
    buffers, layout = pack((batch.inputs, batch.sampling))
    buffers = abstract(buffers)
    return lambda: runner._step.lower(weights, kv, buffers, prev, layout=layout, max_q_len=q).compile()


def warm_up(runner: Runner, background: bool = False, threads: int = 0) -> CompilePool | None:
    """Compile every step shape on `threads` threads (0: one per core, up to 8); with `background`,
    return once the largest of each group is compiled and leave the others to the pool, whose
    `wait()` finishes them. Returns the pool (None with a device proposer: all compiled by then)."""
    if runner.proposer is not None:
        warm_up_by_dispatch(runner)
        return None
    first, rest = ordered(shape_groups(runner))
    pool = CompilePool(runner.ready, threads or default_threads(), len(first) + len(rest))
    runner.ready.complete = False
    state = abstract((runner.step_weights, runner.kv_cache, runner._no_prev))
    pool.submit([(s, compile_job(runner, s, state)) for s in first])
    jobs = [(s, compile_job(runner, s, state)) for s in rest]  # built before serving: they read the persistent batch
    pool.wait()
    pool.submit(jobs)
    pool.finish()
    if not background:
        pool.wait()
    return pool


def warm_up_by_dispatch(runner: Runner) -> None:
    """Run every shape once, one after the other (a runner with a device proposer): the steps, the
    decode loops, the resampler per sequence bucket and the verify steps."""
    jobs = [runner.dummy(*shape) for shape in runner.shapes()]
    if runner.layout.num_scheduler_steps > 1:
        jobs += [
            runner.dummy(sb, sb, w, 1, runner.layout.num_scheduler_steps)
            for sb in runner.layout.seq_buckets
            for w in runner.layout.width_buckets
        ]
    for sb in runner.layout.seq_buckets:
        batch = runner.dummy(sb, sb, runner.layout.width_buckets[0], 1)
        batch.history = runner.inputs.history([], sb)
        jobs.append(batch)
    k = runner.layout.num_speculative_tokens
    for tb, sb, w, q in runner.verify_shapes():
        batch = runner.dummy(tb, sb, w, q)
        batch.spec = verify_arrays(np.zeros((0, k), np.int32), np.zeros(0, np.int32), sb)
        jobs.append(batch)
    for batch in tqdm(jobs, desc="compiling step shapes", unit="shape", leave=False):
        runner.dispatch(batch)
    jax.block_until_ready(runner.kv_cache)
    runner.prev_tokens = runner._no_prev
