"""Run on 8 virtual CPU devices (a subprocess of test_sharding.py): sharded vs single-device checks."""

import dataclasses
import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxinfra.config import ModelConfig  # noqa: E402
from jaxinfra.models import LlamaModel  # noqa: E402
from jaxinfra.train import OptimConfig, TrainConfig, Trainer, per_device_bytes  # noqa: E402
from sharding import MeshConfig, get_rules, make_mesh  # noqa: E402
from tests.sharding_meshes import MESHES, placed  # noqa: E402

CFG = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=8,
    head_dim=8,
    initializer_range=0.1,
)
TC = TrainConfig(
    OptimConfig(warmup_steps=2, total_steps=20, learning_rate=1e-2), microbatches=2, compute_dtype="float32"
)
STEPS = 20


def batch(rows=16):
    """16 rows of 8 tokens: 2 microbatches of 8 rows, one per device of a data-parallel mesh of 8."""
    ids = np.random.default_rng(0).integers(0, 256, (rows, 9))
    return dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=np.ones((rows, 8), np.int32))


def run(shape, preset):
    trainer = Trainer(
        LlamaModel(CFG, nnx.Rngs(0)),
        make_mesh(MeshConfig(*shape), jax.devices()[: int(np.prod(shape))]),
        get_rules(preset),
        TC,
    )
    state = trainer.init_state()
    b = placed(trainer, batch())
    loss, grads = trainer.gradients(state, b)
    flat_grads = [np.asarray(g) for g in jax.tree.leaves(grads)]
    memory = {"params": per_device_bytes(state.params), "opt": per_device_bytes(state.opt_state)}
    compiled = trainer.step.lower(state, b).compile()
    hlo = compiled.as_text()
    losses = []
    for _ in range(STEPS):
        state, m = compiled(state, b)
        losses.append(float(m["loss"]))
    return float(loss), flat_grads, losses, memory, hlo


def indivisible_refused() -> str:
    """8 rows in 2 microbatches on 8 data-parallel devices: 4 rows per microbatch cannot be split."""
    trainer = Trainer(LlamaModel(CFG, nnx.Rngs(0)), make_mesh(MeshConfig(8, 1, 1)), get_rules("dp"), TC)
    state = trainer.init_state()
    try:
        trainer.gradients(state, placed(trainer, batch(rows=8)))
    except ValueError as e:
        return str(e)
    return ""


def main():
    presets = sys.argv[1].split(",")
    ref_loss, ref_grads, ref_losses, _, _ = run((1, 1, 1), "dp")
    report = {"ref_losses": ref_losses, "runs": []}
    for preset in presets:
        for shape in MESHES[preset]:
            loss, grads, losses, memory, hlo = run(shape, preset)
            grad_err = max(float(np.max(np.abs(g - r) / (np.abs(r).max() + 1e-12))) for g, r in zip(grads, ref_grads))
            report["runs"].append(
                {
                    "preset": preset,
                    "mesh": shape,
                    "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
                    "grad_rel_err": grad_err,
                    "curve_rel_err": float(np.max(np.abs(np.array(losses) - ref_losses) / np.abs(ref_losses))),
                    "memory": memory,
                    "all_reduce": hlo.count(" all-reduce("),
                    "all_gather": hlo.count(" all-gather("),
                    "reduce_scatter": hlo.count(" reduce-scatter("),
                }
            )
    from jaxinfra.train.memory import memory_report

    dp_mesh = MeshConfig(8, 1, 1)
    plannable = [p for p in presets if "mlp" not in get_rules(p).params]  # no tensor axis on this mesh
    report["plan"] = [dataclasses.asdict(r) for r in memory_report(CFG, dp_mesh, plannable, 16, 8, TC)]
    try:
        memory_report(CFG, dp_mesh, presets, 16, 8, TC)
        report["tp_without_tensor_axis"] = ""
    except ValueError as e:
        report["tp_without_tensor_axis"] = str(e)
    report["indivisible_refused"] = indivisible_refused()
    print("REPORT" + json.dumps(report))


if __name__ == "__main__":
    main()
