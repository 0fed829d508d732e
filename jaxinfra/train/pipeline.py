"""Pipeline parallelism over the stacked decoder layers: GPipe and circular (interleaved) schedules.

The layers are split into `stages` groups along the `pipeline` mesh axis. Every iteration, each
stage runs its layers on the microbatch it holds (all stages at once: the stage function is vmapped
with the stage dimension sharded over the pipeline axis), then the activations move one stage on
(a collective-permute). GPipe: M microbatches take M + P - 1 iterations. Circular: each stage holds
`repeats` chunks of layers (chunk c on stage c mod P) and every microbatch loops through the stages
`repeats` times, so the P - 1 idle iterations are shared by M x repeats units of work.
Embedding, final norm and loss run outside the pipeline, sharded over all devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from jaxinfra.models.llama import LayerStack, LlamaModel, row_positions
from jaxinfra.models.options import ForwardOptions
from pallas_kernels import DenseMetadata
from sharding import constrain, sharded_axes

SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """P stages, M microbatches, and `repeats` chunks of layers per stage (1 = GPipe)."""

    stages: int
    microbatches: int
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.stages < 1 or self.microbatches < 1 or self.repeats < 1:
            raise ValueError(f"pipeline stages, microbatches and repeats must be >= 1, got {self}")
        if self.repeats > 1 and self.microbatches < self.stages:
            raise ValueError(
                f"the circular schedule needs microbatches >= pipeline stages ({self.microbatches} < {self.stages}): "
                "a microbatch returns to stage 0 while the others are still entering"
            )

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1

    def busy(self) -> np.ndarray:
        """[iterations, stages] bool: whether stage s does real work at iteration n (unit n - s exists)."""
        unit = np.arange(self.iterations)[:, None] - np.arange(self.stages)[None, :]
        return (unit >= 0) & (unit < self.microbatches * self.repeats)

    def bubble_fraction(self) -> float:
        """Idle share of stage-iterations, counted from the schedule: (P - 1) / (M x repeats + P - 1)."""
        return float(1.0 - self.busy().mean())

    def check_layers(self, num_layers: int) -> None:
        chunks = self.stages * self.repeats
        if num_layers % chunks:
            raise ValueError(
                f"{num_layers} decoder layers do not split into {self.stages} pipeline stages x "
                f"{self.repeats} repeats ({chunks} equal chunks)"
            )


def stage_layout(params: Any, schedule: PipelineSchedule) -> Any:
    """Stacked layer params [L, ...] -> [P, repeats, L / (P x repeats), ...]: stage s, repeat r holds
    layers (r x P + s) x chunk ... For GPipe this is a reshape that keeps the pipeline sharding; for
    circular it moves (repeats - 1) / repeats of each stage's weights to other stages."""
    p, v = schedule.stages, schedule.repeats

    def relayout(w: jax.Array) -> jax.Array:
        chunk = w.shape[0] // (p * v)
        w = w.reshape(v, p, chunk, *w.shape[1:]).swapaxes(0, 1)
        return constrain(w, ("stage",) + (None,) * (w.ndim - 1), unmapped_free=True)

    return jax.tree.map(relayout, params)


def pipeline_layers(
    model: LlamaModel,
    stack: LayerStack,
    x: Float[Array, "M b T E"],
    positions: Int[Array, "M b T"],
    segment_ids: Int[Array, "M b T"] | None,
    schedule: PipelineSchedule,
    options: ForwardOptions,
) -> Float[Array, "M b T E"]:
    """The decoder layers on M microbatches through the pipeline; returns their last hidden states."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    weights = stage_layout(stack.params, schedule)
    stage_ids = jnp.arange(p)
    spmd_axis = sharded_axes("stage", p)[0]

    def run_stage(params: Any, h: jax.Array, pos: jax.Array, seg: jax.Array | None) -> jax.Array:
        chunk = LayerStack(stack.graphdef, stack.template, params)
        return model.run_layers(h, pos, DenseMetadata(segment_ids=seg), chunk, options)[0]

    stage_fn = jax.vmap(run_stage, spmd_axis_name=spmd_axis)
    pick_chunk = jax.vmap(lambda w, r: w[r], spmd_axis_name=spmd_axis)
    state_names = ("stage", "batch", "length", "embed")
    buffer_names = (None, "batch", "length", "embed")

    def iteration(carry: tuple[jax.Array, jax.Array], n: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
        state, buf = carry  # state[s]: stage s's input; buf[i]: microbatch i's latest output (or input)
        unit = n - stage_ids  # the unit of work (repeat x M + microbatch) each stage holds
        micro, repeat = unit % m, jnp.clip(unit // m, 0, v - 1)
        params = jax.tree.map(lambda w: pick_chunk(w, repeat), weights)
        seg = None if segment_ids is None else segment_ids[micro]
        out = constrain(stage_fn(params, state, positions[micro], seg), state_names)
        # the last stage's finished unit goes back to its microbatch's slot in the buffer
        last = n - (p - 1)
        slot = last % m
        done = jnp.where((last >= 0) & (last < m * v), out[p - 1], buf[slot])
        buf = constrain(jax.lax.dynamic_update_index_in_dim(buf, done, slot, 0), buffer_names)
        # stage s + 1 takes stage s's output; stage 0 takes the next microbatch (new, or back for
        # its next repeat: it finished stage P - 1 at least one iteration ago since M >= P)
        shifted = jnp.roll(out, 1, axis=0)
        first = jax.lax.dynamic_index_in_dim(buf, (n + 1) % m, 0, keepdims=False)
        state = jnp.where((stage_ids == 0)[:, None, None, None], first[None], shifted)
        return (constrain(state, state_names), buf), None

    state = jnp.zeros((p, *x.shape[1:]), x.dtype).at[0].set(x[0])
    carry = (constrain(state, state_names), constrain(x, buffer_names))
    (_, buf), _ = jax.lax.scan(iteration, carry, jnp.arange(schedule.iterations))
    return buf


def split_microbatches(x: jax.Array, micro: int) -> jax.Array:
    """[B, ...] -> [micro, B / micro, ...], microbatch i taking rows i, i + micro, ... (strided, so
    each microbatch keeps an equal share of every data-parallel device's rows)."""
    return x.reshape(x.shape[0] // micro, micro, *x.shape[1:]).swapaxes(0, 1)


def pipeline_lm_loss(
    model: LlamaModel,
    batch: dict[str, jax.Array],
    stack: LayerStack,
    schedule: PipelineSchedule,
    options: ForwardOptions,
) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy and target count of the batch run through the pipeline."""
    ids = batch["input_ids"]
    positions = batch.get("positions")
    if positions is None:
        positions = row_positions(ids)
    segment_ids = batch.get("segment_ids")
    m = schedule.microbatches
    x = split_microbatches(model.embed_tokens(ids, options.compute_dtype), m)
    h = pipeline_layers(
        model,
        stack,
        x,
        split_microbatches(positions, m),
        None if segment_ids is None else split_microbatches(segment_ids, m),
        schedule,
        options,
    )
    logits = model.logits(model.norm(h))
    targets = split_microbatches(batch["targets"], m)
    mask = split_microbatches(batch["loss_mask"], m).astype(jnp.float32)
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * mask), jnp.sum(mask)
