"""Per-device memory of training under each sharding preset: params, grads and optimizer state
measured from the sharded layout beside the ZeRO paper's accounting (fp32 master weights and grads,
Adam m and v); activations estimated per remat policy (what the forward keeps for the backward);
and XLA's temporary buffers of the compiled step, which also hold gradients and gathered weights."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfra.config import ModelConfig
from jaxinfra.models import LlamaModel
from jaxinfra.train.step import TrainConfig, Trainer, sharded_bytes
from sharding import MeshConfig, get_rules, logical_rules, make_mesh, parallel_sizes


@dataclasses.dataclass
class MemoryRow:
    preset: str
    params: int
    grads: int
    optimizer: int
    activations: float  # analytic estimate: what the forward keeps for the backward, one microbatch
    xla_temp: int  # compiled step's temporary buffers (XLA's memory analysis)
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


FLASH_IMPLS = ("pallas", "cudnn")  # attention that keeps O(T) state (output, log-sum-exp) for the backward


def activation_bytes(
    cfg: ModelConfig,
    rows: int,
    seq_len: int,
    remat: str,
    compute_dtype: str = "bfloat16",
    attn_impl: str = "pallas",
    tensor: int = 1,
    context: int = 1,
) -> float:
    """Bytes one device keeps from the forward for the backward, for `rows` rows of one microbatch
    on that device: per layer by remat policy, plus the float32 logits and the final norm.

    full: the layer inputs. save_dots: also every matmul output the backward needs (Q/K/V, o_proj,
    gate/up, and with materialized attention the float32 scores and P.V). none: every intermediate
    (norms in float32, RoPE, softmax, SwiGLU). Head and MLP terms split over the tensor axis, token
    terms over the context axis (each device attends its queries to the whole sequence)."""
    a = jnp.dtype(compute_dtype).itemsize
    e, m, h, kh, d, v = (
        cfg.hidden_size,
        cfg.intermediate_size / tensor,
        cfg.num_heads / tensor,
        cfg.num_kv_heads / tensor,
        cfg.head_dim,
        cfg.vocab_size / tensor,
    )
    n = rows * seq_len / context  # tokens this device holds
    scores = 0.0 if attn_impl in FLASH_IMPLS else rows * h * (seq_len / context) * seq_len
    if remat == "full":
        layer = n * e * a
    elif remat == "save_dots":
        layer = 2 * n * e * a + n * (h + 2 * kh) * d * a + 2 * n * m * a + scores * 4 + (n * h * d * 4 if scores else 0)
    else:
        attention = 3 * scores * 4 if scores else n * h * d * a + n * h * 4  # scores/probs, or flash's out + LSE
        layer = n * e * (8 + 4 * a) + 6 * n * m * a + n * d * (2 * h * a + kh * (a + 4)) + attention
    outside = n * v * 4 + n * e * (4 + 2 * a) + (5 * scores if remat == "none" else 0)
    return cfg.num_layers * layer + outside


def measured_activation_bytes(trainer: Trainer, rows: int, seq_len: int) -> int:
    """What the compiled forward of `trainer`'s loss keeps for the backward (its vjp residuals), for
    `rows` rows: residuals at 2 x rows minus at rows, so weights kept for the backward drop out."""

    def residual_bytes(r: int) -> int:
        tokens = jax.ShapeDtypeStruct((r, seq_len), jnp.int32)
        batch = {"input_ids": tokens, "targets": tokens, "loss_mask": tokens}

        def forward(params: Any, batch: dict) -> list:
            with logical_rules(trainer.mesh, trainer.rules.activations):
                _, backward = jax.vjp(lambda p: trainer._loss(p, batch)[0], params)
            return [x for x in jax.tree.leaves(backward) if isinstance(x, jax.Array)]

        params = jax.eval_shape(lambda: trainer._params)
        stats = jax.jit(forward).lower(params, batch).compile().memory_analysis()
        if stats is None:
            raise ValueError("this backend's compiler reports no memory analysis")
        return int(stats.output_size_in_bytes)

    return residual_bytes(2 * rows) - residual_bytes(rows)


def memory_report(
    cfg: ModelConfig,
    mesh_config: MeshConfig,
    presets: list[str],
    batch: int,
    seq_len: int,
    train: TrainConfig = TrainConfig(),
    attn_impl: str = "pallas",
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
                sharded_bytes(trainer.model_def.partition(state.params)[0], trainer.grad_shardings),
                sharded_bytes(state.opt_state, trainer.opt_shardings),
                activation_bytes(
                    cfg,
                    batch // (train.microbatches * dp),
                    seq_len,
                    train.remat,
                    train.compute_dtype,
                    attn_impl,
                    tp if "mlp" in get_rules(preset).activations else 1,
                ),
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
        f"{'(ZeRO)':>10} {'activ.':>10} {'XLA temp':>10}   MiB per device"
    ]
    for r in rows:
        lines.append(
            f"{r.preset:<8} {mib(r.params)} {mib(r.analytic_params)} {mib(r.grads)} {mib(r.analytic_grads)} "
            f"{mib(r.optimizer)} {mib(r.analytic_optimizer)} {mib(r.activations)} {mib(r.xla_temp)}"
        )
    lines.append(
        "activ.: estimate of what the forward keeps for the backward (one microbatch, by remat policy); "
        "XLA temp: the compiled step's temporaries (also gradients, gathered weights, the optimizer update)"
    )
    return "\n".join(lines)
