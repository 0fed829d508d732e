"""Run on 8 virtual CPU devices (a subprocess of test_grad_reduce.py): the dtype of every cross-device
gradient reduction the SPMD partitioner emits for a bfloat16 train step, per grad_reduce_dtype.

The HLO is read right after SPMD partitioning: the CPU compiler later widens every bfloat16
all-reduce to float32 itself, which a GPU compiler does not. Prints one JSON report."""

import json
import os
import re
import sys
import tempfile
from pathlib import Path

DUMP = Path(tempfile.mkdtemp(prefix="grad_reduce_"))
os.environ["XLA_FLAGS"] = f"--xla_dump_to={DUMP} --xla_dump_hlo_pass_re=spmd-partitioning"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxinfra.models import LlamaModel  # noqa: E402
from jaxinfra.train import TrainConfig, Trainer  # noqa: E402
from sharding import MeshConfig, get_rules, make_mesh  # noqa: E402
from tests.sharding.pipeline_check import CFG, batch  # noqa: E402
from tests.sharding_meshes import placed  # noqa: E402


def reductions(preset: str, mesh: MeshConfig, grad_reduce_dtype: str) -> dict:
    """Reductions by dtype in the partitioned step, and the loss and gradients of the batch."""
    cfg = TrainConfig(microbatches=2, compute_dtype="bfloat16", grad_reduce_dtype=grad_reduce_dtype)
    trainer = Trainer(LlamaModel(CFG, nnx.Rngs(0)), make_mesh(mesh), get_rules(preset), cfg)
    state = trainer.init_state()
    b = placed(trainer, batch(rows=32, seq=32))
    before = set(DUMP.iterdir())
    trainer.step.lower(state, b).compile()
    (hlo,) = [p for p in set(DUMP.iterdir()) - before if "step_impl" in p.name and "after_spmd-partitioning" in p.name]
    counts: dict[str, int] = {}
    for dtype, op in re.findall(r"= \(?(\w+)\[[^\n]*? (all-reduce|reduce-scatter)\(", hlo.read_text()):
        counts[f"{op} {dtype}"] = counts.get(f"{op} {dtype}", 0) + 1
    loss, grads = trainer.gradients(state, b)
    return {"counts": counts, "loss": float(loss), "grads": [np.asarray(g).tolist() for g in jax.tree.leaves(grads)]}


def main() -> None:
    report = {
        f"{preset}/{dtype}": reductions(preset, mesh, dtype)
        for preset, mesh in (("fsdp", MeshConfig(data=2, fsdp=4)),)
        for dtype in ("float32", "compute")
    }
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
