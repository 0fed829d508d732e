"""What compiling the train step costs at a given depth: seconds and the size of the compiled program."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from flax import nnx

from jaxinfra.config import ModelConfig
from jaxinfra.models import LlamaModel
from jaxinfra.train.optimizer import OptimConfig
from jaxinfra.train.step import TrainConfig, Trainer
from sharding import MeshConfig, get_rules, make_mesh


def narrow_config(layers: int) -> ModelConfig:
    """A Llama narrow enough that compiling is all the step costs."""
    return ModelConfig(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
        dtype="float32",
    )


@dataclasses.dataclass(frozen=True)
class CompileCost:
    layers: int
    scan_layers: bool
    seconds: float
    hlo_ops: int  # instructions in the optimized HLO


def train_step_compile_cost(
    layers: int, scan_layers: bool, preset: str = "fsdp", batch: int = 8, seq_len: int = 32
) -> CompileCost:
    """Lower and compile the sharded train step of a narrow Llama with `layers` decoder layers."""
    cfg = narrow_config(layers)
    model = nnx.eval_shape(lambda: LlamaModel(cfg, nnx.Rngs(0)))
    train_cfg = TrainConfig(OptimConfig(), remat="full", compute_dtype="bfloat16", scan_layers=scan_layers)
    trainer = Trainer(model, make_mesh(MeshConfig(-1, 1, 1)), get_rules(preset), train_cfg)
    rows = np.zeros((batch, seq_len), np.int32)
    shaped = {k: jax.ShapeDtypeStruct(rows.shape, rows.dtype) for k in ("input_ids", "targets", "loss_mask")}
    start = time.perf_counter()
    compiled = trainer.step.lower(trainer.abstract_state(), shaped).compile()
    seconds = time.perf_counter() - start
    hlo = compiled.as_text() or ""
    ops = sum(1 for line in hlo.splitlines() if " = " in line and not line.lstrip().startswith("//"))
    return CompileCost(layers, scan_layers, seconds, ops)
