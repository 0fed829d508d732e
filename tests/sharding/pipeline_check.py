"""Run on 8 virtual CPU devices (a subprocess of test_sharding.py): pipeline parallelism (4 stages x
2 data, GPipe and circular) against the same model without a pipeline. Prints one JSON report."""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxinfra.config import ModelConfig  # noqa: E402
from jaxinfra.models import LlamaModel  # noqa: E402
from jaxinfra.train import OptimConfig, TrainConfig, Trainer  # noqa: E402
from sharding import MeshConfig, get_rules, make_mesh  # noqa: E402
from tests.sharding_meshes import placed  # noqa: E402

CFG = ModelConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=8,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    initializer_range=0.1,
)
STEPS = 20
MICRO = 4


def batch(rows: int = 16, seq: int = 16) -> dict:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab_size, (rows, seq + 1))
    segments = np.cumsum(rng.random((rows, seq)) < 0.15, axis=1).astype(np.int32)
    starts = np.concatenate([np.ones((rows, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    positions = np.zeros((rows, seq), np.int32)
    for r in range(rows):
        for t in range(seq):
            positions[r, t] = 0 if starts[r, t] else positions[r, t - 1] + 1
    return dict(
        input_ids=ids[:, :-1],
        targets=ids[:, 1:],
        loss_mask=(rng.random((rows, seq)) < 0.9).astype(np.int32),
        segment_ids=segments,
        positions=positions,
    )


def run(mesh: MeshConfig, devices: int, preset: str, schedule: str, remat: str = "none") -> dict:
    cfg = TrainConfig(
        OptimConfig(warmup_steps=2, total_steps=STEPS, learning_rate=1e-2),
        microbatches=MICRO,
        remat=remat,
        compute_dtype="float32",
        pipeline_schedule=schedule,
    )
    trainer = Trainer(LlamaModel(CFG, nnx.Rngs(0)), make_mesh(mesh, jax.devices()[:devices]), get_rules(preset), cfg)
    state = trainer.init_state()
    b = placed(trainer, batch())
    compiled = trainer.step.lower(state, b).compile()
    hlo = compiled.as_text()
    losses = []
    for _ in range(STEPS):
        state, metrics = compiled(state, b)
        losses.append(float(metrics["loss"]))
    layer_shard = state.params["layers"]["mlp"]["up_proj"].addressable_shards[0].data.shape
    return {
        "losses": losses,
        "bubble": None if trainer.pipeline is None else trainer.pipeline.bubble_fraction(),
        "collective_permutes": hlo.count("collective-permute-start(") + hlo.count("collective-permute("),
        "layer_shard": list(layer_shard),
    }


def main() -> None:
    report = {
        "reference": run(MeshConfig(data=2), 2, "dp", "gpipe"),
        "gpipe": run(MeshConfig(data=2, pipeline=4), 8, "dp", "gpipe"),
        "circular": run(MeshConfig(data=2, pipeline=4), 8, "dp", "circular"),
        "gpipe_fsdp_remat": run(MeshConfig(data=1, fsdp=2, pipeline=4), 8, "fsdp", "gpipe", "full"),
        "circular_tp": run(MeshConfig(data=1, tensor=2, pipeline=4), 8, "tp", "circular"),
    }
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
