"""Sharded training step: fp32 master weights, bf16 (or fp32) compute, AdamW, gradient accumulation,
remat, and in/out shardings from a named preset of logical-axis rules.

Parameters and optimizer state are plain nested dicts of arrays (the model's nnx.Param tree); the
model is rebuilt inside the step from the graph definition, so the same Flax module trains and serves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfra.lora.adapter import LoraParam, join_params, split_params
from jaxinfra.models import ForwardOptions, LlamaModel, moe
from jaxinfra.models.llama import LayerStack, merge_params, row_positions, stack_layers, unstack_layers
from jaxinfra.models.options import REMAT_POLICIES
from jaxinfra.models.sharded_attention import zigzag_order
from jaxinfra.train.optimizer import OptimConfig, make_optimizer
from jaxinfra.train.pipeline import SCHEDULES, PipelineSchedule, pipeline_lm_loss, split_microbatches
from pallas_kernels import DenseMetadata, default_impl
from sharding import ShardingRules, dim_shards, logical_rules, named_sharding
from sharding.logical import Rules

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The sharded step: its optimizer, gradient accumulation, rematerialisation and compute dtype."""

    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    microbatches: int = 1  # gradient accumulation: the batch in this many pieces
    remat: str = "none"  # per decoder layer: none | full | save_dots
    compute_dtype: str = "bfloat16"  # matmuls and activations; master weights stay float32
    scan_layers: bool = True  # one lax.scan over the decoder layers: compile time independent of depth
    pipeline_schedule: str = "gpipe"  # on a mesh with pipeline > 1: gpipe | circular
    pipeline_repeats: int = 2  # circular: chunks of layers per stage (microbatches loop this many times)
    # float32: weights stay float32 masters into the model (cast at each use), so weight gradients
    # leave their matmuls, and cross the devices, in float32; compute: weights cast to compute_dtype
    # first, gradients reduced in it (half the bytes on the wire)
    grad_reduce_dtype: str = "float32"
    # mixture of experts (no effect on dense models): loss = CE + aux_coef * load-balancing loss +
    # z_coef * router z-loss (each averaged over MoE layers); capacity_factor drops copies past
    # ceil(factor * copies / experts) per expert and batch (None: dropless)
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.001
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"TrainConfig.capacity_factor must be > 0 or null, got {self.capacity_factor}")
        if self.grad_reduce_dtype not in ("float32", "compute"):
            raise ValueError(
                f"TrainConfig.grad_reduce_dtype must be float32 or compute, got {self.grad_reduce_dtype!r}"
            )
        if self.pipeline_schedule not in SCHEDULES:
            raise ValueError(
                f"TrainConfig.pipeline_schedule must be one of {SCHEDULES}, got {self.pipeline_schedule!r}"
            )
        if self.pipeline_repeats < 2 and self.pipeline_schedule == "circular":
            raise ValueError(f"TrainConfig.pipeline_repeats must be >= 2 for circular, got {self.pipeline_repeats}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"TrainConfig.remat must be one of {tuple(REMAT_POLICIES)}, got {self.remat!r}")
        if self.microbatches < 1:
            raise ValueError(f"TrainConfig.microbatches must be >= 1, got {self.microbatches}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"TrainConfig.compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array
    params: Params
    opt_state: Any


class ModelDef:
    """The model's graph and parameter layout: rebuild a module from a params dict, shard by rules.

    With `scan_layers` the decoder layers' parameters live stacked on a leading `layers` axis
    (params["layers"][name] is [L, ...]): the step runs them as one scan and the optimizer updates
    one array per weight kind, so the compiled step does not grow with depth. `build` and
    `per_layer` give the usual one-module-per-layer form (checkpoints, export, evaluation).
    With LoRA adapters only they train (`partition`): the base gets no gradients or optimizer state."""

    def __init__(self, model: LlamaModel, scan_layers: bool = False) -> None:
        self.graphdef, state = nnx.split(model, nnx.Param)
        self.template = nnx.to_flat_state(state)
        self.axes = {path: var.get_metadata()["logical_axes"] for path, var in self.template}
        self.adapters = {path for path, var in self.template if isinstance(var, LoraParam)}
        self.num_layers = len(model.layers)
        self.scan = scan_layers and self.num_layers > 0
        if self.scan:
            graphdef, layer_state = nnx.split(model.layers[0])
            self.layer_graphdef, self.layer_template = graphdef, list(nnx.to_flat_state(layer_state))

    def params_of(self, model: LlamaModel) -> Params:
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return stack_layers(params) if self.scan else params

    def per_layer(self, params: Params) -> Params:
        """Stacked params -> one entry per layer (identity without scan_layers)."""
        return unstack_layers(params, self.num_layers) if self.scan else params

    def layer_stack(self, params: Params) -> LayerStack | None:
        if not self.scan:
            return None
        return LayerStack(self.layer_graphdef, self.layer_template, params["layers"])

    def build(self, params: Params) -> LlamaModel:
        return merge_params(self.graphdef, self.template, self.per_layer(params))

    def _layer0(self, path: tuple) -> tuple:
        """A stacked layer parameter's path as layer 0's (identity for the rest)."""
        return ("layers", 0, *path[1:]) if self.scan and path[0] == "layers" else path

    def logical_axes(self, path: tuple) -> tuple:
        return ("layers", *self.axes[self._layer0(path)]) if self.scan and path[0] == "layers" else self.axes[path]

    def partition(self, params: Params) -> tuple[Params, Params]:
        """(trained, frozen) parts of a params dict: (adapters, the rest) if any, else (all, {})."""
        return split_params(params, lambda p: not self.adapters or self._layer0(p) in self.adapters)

    def shardings(self, params: Params, mesh: Mesh, rules: Rules) -> Params:
        flat = traverse_util.flatten_dict(params)
        return traverse_util.unflatten_dict(
            {p: named_sharding(self.logical_axes(p), rules, x.shape, mesh) for p, x in flat.items()}
        )


def lm_loss(
    model: LlamaModel,
    batch: dict[str, jax.Array],
    layer_stack: LayerStack | None = None,
    options: ForwardOptions = ForwardOptions(),
) -> tuple[jax.Array, jax.Array, moe.RouterStats | None]:
    """Summed next-token cross-entropy over unmasked targets, the number of those targets, and the
    router's statistics (MoE models, when options.router_stats)."""
    ids = batch["input_ids"]
    positions = batch.get("positions")
    metadata = DenseMetadata(segment_ids=batch.get("segment_ids"))
    logits, _, stats = model.forward(
        ids, row_positions(ids) if positions is None else positions, metadata, None, layer_stack, options
    )
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask), stats


class Trainer:
    """Owns the shardings and the jitted step for one (model, mesh, preset, config)."""

    def __init__(self, model: LlamaModel, mesh: Mesh, rules: ShardingRules, cfg: TrainConfig) -> None:
        self.model_def = ModelDef(model, cfg.scan_layers)
        self.mesh, self.rules, self.cfg = mesh, rules, cfg
        self.pipeline = pipeline_schedule(mesh, cfg, self.model_def)
        # Our flash kernel skips keys past each query's position: with the sequence split over the
        # context axis, rows are reordered so every device gets equal causal work (zigzag).
        impl = (model.layers[0].attn.attn_impl if model.layers else None) or default_impl()
        self.zigzag_parts = mesh.shape.get("context", 1) if impl == "pallas" else 1
        self.optimizer = make_optimizer(cfg.optim)
        params = jax.tree.map(_to_fp32, self.model_def.params_of(model))
        self.param_shardings = self.model_def.shardings(params, mesh, rules.params)
        opt_param_shardings = self.model_def.partition(self.model_def.shardings(params, mesh, rules.optimizer))[0]
        replicated = NamedSharding(mesh, PartitionSpec())
        abstract_opt = jax.eval_shape(self.optimizer.init, self.model_def.partition(params)[0])
        self.opt_shardings = optax.tree_map_params(
            self.optimizer, lambda _, s: s, abstract_opt, opt_param_shardings, transform_non_params=lambda _: replicated
        )
        trained_shardings = self.model_def.partition(self.param_shardings)[0]
        self.grad_shardings = opt_param_shardings if rules.shard_grads else trained_shardings
        # the state's shardings, as a pytree of the state's structure
        self.state_shardings = TrainState(cast(Any, replicated), self.param_shardings, self.opt_shardings)
        self.batch_sharding = NamedSharding(mesh, PartitionSpec(rules.activations.get("batch")))
        self._init = jax.jit(self._init_impl, out_shardings=self.state_shardings)
        self._params = params  # fp32 master weights (abstract for a model built with nnx.eval_shape)
        self.step = jax.jit(
            self._step_impl,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=(0,),
        )
        self.eval_step = jax.jit(
            self._eval_impl,
            in_shardings=(self.param_shardings, self.batch_sharding),
            out_shardings=(replicated, replicated),
        )

    def init_state(self, make_params: Callable[[], Params] | None = None) -> TrainState:
        """State from the model's weights, or from `make_params()` run under jit straight into the
        sharded layout (random init of a model too large for one device)."""
        if make_params is None:
            return self._init(jax.device_put(self._params, self.param_shardings))
        init = jax.jit(lambda: jax.tree.map(_to_fp32, make_params()), out_shardings=self.param_shardings)
        return self._init(init())

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state, without allocating it."""
        shaped = jax.eval_shape(self._init_impl, self._params)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shaped, self.state_shardings
        )

    def _init_impl(self, params: Params) -> TrainState:
        return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(self.model_def.partition(params)[0]))

    def shard_batch(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
        """Global batch (the same numpy arrays on every process) -> arrays sharded over the mesh; each
        process only places the rows its own devices hold, so this works across hosts too."""

        def place(x: Any) -> jax.Array:
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, self.batch_sharding, lambda idx: x[idx])

        return {k: place(v) for k, v in batch.items()}

    def place_local_batch(self, rows: dict[str, np.ndarray], global_rows: int) -> dict[str, jax.Array]:
        """This process's rows of a global batch (its devices' rows, in process order) -> global arrays."""
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, v, (global_rows, *v.shape[1:]))
            for k, v in rows.items()
        }

    def _loss(self, params: Params, batch: dict[str, jax.Array], key: Any = None) -> tuple[jax.Array, dict]:
        """The summed objective (cross-entropy, plus the router losses of MoE models scaled by the
        target count) and its parts: count, ce (summed), and for MoE the router's statistics. `key`:
        LoRA dropout's (ForwardOptions.dropout_key)."""
        ce, count, router = self._ce(params, batch, key)
        parts = {"count": count, "ce": ce}
        if router is None:
            return ce, parts
        penalty = self.cfg.router_aux_loss_coef * router.aux_loss + self.cfg.router_z_loss_coef * router.z_loss
        parts.update(
            moe_aux_loss=router.aux_loss * count, moe_z_loss=router.z_loss * count, expert_tokens=router.counts
        )
        return ce + count * penalty, parts

    def _ce(self, params: Params, batch: dict, key: Any) -> tuple[jax.Array, jax.Array, moe.RouterStats | None]:
        compute = jnp.dtype(self.cfg.compute_dtype)
        masters = self.cfg.grad_reduce_dtype == "float32" and compute != jnp.float32
        if not masters:
            params = jax.tree.map(lambda p: p.astype(compute), params)
        model = self.model_def.build(params)  # its per-layer slices go unused (dead code) when scanned
        stack = self.model_def.layer_stack(params)
        zigzag = self.zigzag_parts > 1
        if zigzag:
            batch = _reorder_tokens(batch, zigzag_order(batch["input_ids"].shape[1], self.zigzag_parts))
        options = ForwardOptions(
            fused_projections=True,  # one input-gradient reduction for Q/K/V and one for gate/up under TP
            capacity_factor=self.cfg.capacity_factor,
            router_stats=True,
            zigzag=zigzag,
            remat=self.cfg.remat,  # per decoder layer
            compute_dtype=self.cfg.compute_dtype if masters else None,
            dropout_key=key,
        )
        if self.pipeline is not None and stack is not None:
            if model.cfg.num_experts:
                raise ValueError("pipeline parallelism does not run mixture-of-experts models")
            return *pipeline_lm_loss(model, batch, stack, self.pipeline, options), None
        return lm_loss(model, batch, stack, options)

    def loss_and_grads(
        self, params: Params, batch: dict[str, jax.Array], dropout_key: jax.Array | None = None
    ) -> tuple[jax.Array, Params, dict[str, jax.Array]]:
        """Mean cross-entropy and gradients (of the whole objective) over the batch, accumulated over
        `microbatches` (traced in the step), and the objective's parts summed (see _loss); gradients
        of the trained parameters only (ModelDef.partition). `dropout_key`: LoRA dropout's, if any."""
        micro = self.cfg.microbatches
        rows, length = next(iter(batch.values())).shape[:2]
        self.check_batch(rows, length)
        params, frozen = self.model_def.partition(params)
        loss_fn = lambda p, b: self._loss(join_params(p, frozen), b, dropout_key)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if self.pipeline is not None:  # the pipeline runs the microbatches itself, in one pass
            (_, parts), grads = grad_fn(params, batch)
            return self._mean(parts, grads)
        split = jax.tree.map(lambda x: split_microbatches(x, micro), batch)

        def accumulate(carry, mb):
            grads, parts = carry
            (_, p), g = grad_fn(params, mb)
            return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, parts, p)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        shapes = jax.eval_shape(loss_fn, params, jax.tree.map(lambda x: x[0], split))[1]
        init = (zeros, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
        (grads, parts), _ = jax.lax.scan(accumulate, init, split)
        return self._mean(parts, grads)

    def _mean(self, parts: dict[str, jax.Array], grads: Params) -> tuple[jax.Array, Params, dict[str, jax.Array]]:
        """Summed loss and gradients -> per-target means, gradients in their (ZeRO) layout."""
        count = jnp.maximum(parts["count"], 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        return parts["ce"] / count, jax.lax.with_sharding_constraint(grads, self.grad_shardings), parts

    def check_batch(self, rows: int, length: int | None = None) -> None:
        """Batch rows must split into `microbatches` equal parts, each spread evenly over the devices
        the batch is sharded across (otherwise every device would compute whole microbatches), and
        the sequence evenly over the context axis."""
        context = self.mesh.shape.get("context", 1)
        if length is not None and length % context:
            raise ValueError(
                f"sequence length {length} does not split over the {context} devices of the context mesh axis"
            )
        micro = self.cfg.microbatches
        shards = dim_shards(self.batch_sharding)
        if rows % micro or (rows // micro) % shards:
            raise ValueError(
                f"a batch of {rows} rows in TrainConfig.microbatches={micro} microbatches must give each "
                f"microbatch a multiple of {shards} rows (the devices the batch is split over)"
            )

    def _step_impl(self, state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        dropout_key = jax.random.fold_in(jax.random.key(0), state.step)  # LoRA dropout's, if any
        with logical_rules(self.mesh, self.rules.activations):  # ZeRO-2/3: grads reduce-scattered
            loss, grads, parts = self.loss_and_grads(state.params, batch, dropout_key)
            trained, frozen = self.model_def.partition(state.params)
            updates, opt_state = self.optimizer.update(grads, state.opt_state, trained)
            params = join_params(optax.apply_updates(trained, updates), frozen)
        count = parts["count"]
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "tokens": count}
        if "expert_tokens" in parts:  # per-expert load for the logs: tokens per expert per MoE layer
            n = jnp.maximum(count, 1.0)
            metrics.update(
                moe_aux_loss=parts["moe_aux_loss"] / n,
                moe_z_loss=parts["moe_z_loss"] / n,
                expert_tokens=parts["expert_tokens"],
                expert_imbalance=moe.imbalance(parts["expert_tokens"]),
            )
        return TrainState(state.step + 1, params, opt_state), metrics

    def _eval_impl(self, params: Params, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        with logical_rules(self.mesh, self.rules.activations):
            _, parts = self._loss(params, batch)
        return parts["ce"], parts["count"]

    def gradients(self, state: TrainState, batch: dict[str, jax.Array]) -> tuple[jax.Array, Params]:
        """Loss and gradients at `state` without updating (for checks)."""

        def fn(params, batch):
            with logical_rules(self.mesh, self.rules.activations):
                loss, grads, _ = self.loss_and_grads(params, batch)
            return loss, grads

        return jax.jit(fn)(state.params, batch)


def pipeline_schedule(mesh: Mesh, cfg: TrainConfig, model_def: ModelDef) -> PipelineSchedule | None:
    """The pipeline schedule of a mesh with a pipeline axis (None without one): `microbatches`
    microbatches flow through it in one pass."""
    stages = mesh.shape.get("pipeline", 1)
    if stages == 1:
        return None
    if not model_def.scan:
        raise ValueError("pipeline parallelism runs the stacked decoder layers: it needs scan_layers=True")
    repeats = cfg.pipeline_repeats if cfg.pipeline_schedule == "circular" else 1
    schedule = PipelineSchedule(stages, cfg.microbatches, repeats)
    schedule.check_layers(model_def.num_layers)
    return schedule


def _reorder_tokens(batch: dict[str, jax.Array], order: np.ndarray) -> dict[str, jax.Array]:
    """Every [B, T] array of the batch with its tokens in `order` (positions made explicit first, as
    RoPE needs each token's own); the loss is a sum over tokens, so it does not change."""
    if "positions" not in batch:
        batch = {**batch, "positions": row_positions(batch["input_ids"])}
    return {k: v[:, order] for k, v in batch.items()}


def _to_fp32(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, jnp.float32)
    return x.astype(jnp.float32)


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded arrays (device 0's shards)."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def sharded_bytes(tree: Any, shardings: Any) -> int:
    """Bytes one device would hold of arrays (or shapes) `tree` laid out by `shardings`."""
    return sum(
        math.prod(s.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))
    )
