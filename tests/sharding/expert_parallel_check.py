"""Run on 8 virtual CPU devices (a subprocess of test_expert_parallel.py): 20 training steps of a tiny
MoE on one device and under expert parallelism (2 data x 4 expert, preset "ep"), and the compiled
step's collectives. Prints one JSON report."""

import json
import re
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import jaxinfra  # noqa: E402
from jaxinfra.train import OptimConfig, TrainConfig, Trainer  # noqa: E402
from sharding import MeshConfig, get_rules, make_mesh  # noqa: E402
from tests.sharding_meshes import placed  # noqa: E402

STEPS = 20


def run(mesh_cfg: MeshConfig, preset: str, devices: list) -> tuple[list[float], list[list[float]], str]:
    model = jaxinfra.load_model("tiny-mixtral", dtype="float32")
    cfg = TrainConfig(OptimConfig(learning_rate=3e-3, warmup_steps=2, total_steps=STEPS), compute_dtype="float32")
    trainer = Trainer(model, make_mesh(mesh_cfg, devices), get_rules(preset), cfg)
    rng = np.random.default_rng(0)
    state = trainer.init_state()
    losses, loads, hlo = [], [], ""
    for step in range(STEPS):
        ids = rng.integers(0, 512, (8, 33))
        batch = placed(trainer, dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=np.ones((8, 32), np.int32)))
        if step == 0:
            hlo = trainer.step.lower(state, batch).compile().as_text()
        state, m = trainer.step(state, batch)
        losses.append(float(m["loss"]))
        loads.append(np.asarray(m["expert_tokens"]).tolist())
    return losses, loads, hlo


def expert_weight_gathers(hlo: str) -> list[str]:
    """All-gathers whose result has an expert weight's shape (any dtype): [experts, E, F] or [experts, F, E]."""
    shapes = ("[4,64,96]", "[4,96,64]", "[2,4,64,96]", "[2,4,96,64]")
    return [line.strip()[:160] for line in hlo.splitlines() if "all-gather" in line and any(s in line for s in shapes)]


single = run(MeshConfig(1, 1, 1), "dp", jax.devices()[:1])
ep = run(MeshConfig(data=2, fsdp=1, tensor=1, expert=4), "ep", jax.devices())
json.dump(
    {
        "single_losses": single[0],
        "ep_losses": ep[0],
        "single_loads": single[1],
        "ep_loads": ep[1],
        "all_to_all": len(re.findall(r"all-to-all\(", ep[2])),
        "expert_weight_gathers": expert_weight_gathers(ep[2]),
    },
    sys.stdout,
)
