"""Per-device memory of training under each sharding preset: measured from the sharded layout,
beside the ZeRO paper's analytic accounting (fp32 master weights and grads, Adam m and v)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfra.config import ModelConfig
from jaxinfra.models import LlamaModel
from jaxinfra.train.step import TrainConfig, Trainer, sharded_bytes
from sharding import MeshConfig, get_rules, make_mesh, parallel_sizes


@dataclasses.dataclass
class MemoryRow:
    preset: str
    params: int
    grads: int
    optimizer: int
    activations: int  # compiled step's temporary buffers (XLA's memory analysis)
    analytic_params: float
    analytic_grads: float
    analytic_optimizer: float


def analytic(num_params: int, preset: str, dp: int, tp: int) -> tuple[float, float, float]:
    """ZeRO: 16 bytes/param in all (their 2+2+12 with fp16 weights; here 4 fp32 weights + 4 grads +
    8 Adam), divided over the ranks that shard each part."""
    rules = get_rules(preset)
    split_params = dp if "embed" in rules.params else 1
    split_opt = dp if "embed" in rules.optimizer else 1
    split_grads = split_opt if rules.shard_grads else split_params
    t = tp if "mlp" in rules.params else 1
    return 4 * num_params / (split_params * t), 4 * num_params / (split_grads * t), 8 * num_params / (split_opt * t)


def memory_report(
    cfg: ModelConfig,
    mesh_config: MeshConfig,
    presets: list[str],
    batch: int,
    seq_len: int,
    train: TrainConfig = TrainConfig(),
) -> list[MemoryRow]:
    abstract_model = nnx.eval_shape(lambda: LlamaModel(cfg, nnx.Rngs(0)))
    mesh = make_mesh(mesh_config)
    dp, tp = parallel_sizes(mesh)
    for preset in presets:  # a tensor-parallel preset on a mesh without a tensor axis is plain data parallelism
        if "mlp" in get_rules(preset).params and tp == 1:
            raise ValueError(f"preset {preset} shards over the tensor axis, but the mesh {mesh_config} has tensor=1")
    rows = []
    for preset in presets:
        trainer = Trainer(abstract_model, mesh, get_rules(preset), train)
        state = trainer.abstract_state()
        tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=trainer.batch_sharding)
        abstract_batch = {"input_ids": tokens, "targets": tokens, "loss_mask": tokens}
        compiled = trainer.step.lower(state, abstract_batch).compile()
        stats = compiled.memory_analysis()
        rows.append(
            MemoryRow(
                preset,
                sharded_bytes(state.params, trainer.param_shardings),
                sharded_bytes(state.params, trainer.grad_shardings),
                sharded_bytes(state.opt_state, trainer.opt_shardings),
                int(getattr(stats, "temp_size_in_bytes", 0)) if stats is not None else 0,
                *analytic(cfg.num_params, preset, dp, tp),
            )
        )
    return rows


def format_report(rows: list[MemoryRow]) -> str:
    def mib(x: float) -> str:
        return f"{x / 2**20:10.1f}"

    lines = [
        f"{'preset':<8} {'params':>10} {'(ZeRO)':>10} {'grads':>10} {'(ZeRO)':>10} {'optimizer':>10} "
        f"{'(ZeRO)':>10} {'activ.':>10}   MiB per device"
    ]
    for r in rows:
        lines.append(
            f"{r.preset:<8} {mib(r.params)} {mib(r.analytic_params)} {mib(r.grads)} {mib(r.analytic_grads)} "
            f"{mib(r.optimizer)} {mib(r.analytic_optimizer)} {mib(r.activations)}"
        )
    return "\n".join(lines)
