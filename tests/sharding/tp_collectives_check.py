"""Run on 8 virtual CPU devices (a subprocess of test_sharding.py): the activation all-reduces of a
tensor-parallel train step, per computation of the compiled program (the scanned layer bodies)."""

import json
import re
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
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8
)
ACTIVATION = "f32[4,8,64]"  # one device's rows (16 rows over 4 data shards) x 8 tokens x hidden 64


def activation_all_reduces(remat: str) -> dict[str, int]:
    trainer = Trainer(
        LlamaModel(CFG, nnx.Rngs(0)),
        make_mesh(MeshConfig(4, 1, 2)),
        get_rules("tp"),
        TrainConfig(OptimConfig(), remat=remat, compute_dtype="float32"),
    )
    hlo = trainer.step.lower(trainer.abstract_state(), _batch(trainer)).compile().as_text()
    counts = {}
    for comp in re.split(r"\n(?=\S)", hlo):
        name = comp.split(" ", 1)[0]
        results = [line.split(" all-reduce(")[0] for line in comp.splitlines() if " all-reduce(" in line]
        n = sum(r.count(ACTIVATION) for r in results)
        if n and not name.startswith("ENTRY"):
            counts[name] = n
    return counts


def _batch(trainer):
    ids = np.random.default_rng(0).integers(0, 256, (16, 9))
    return placed(trainer, dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=np.ones((16, 8), np.int32)))


if __name__ == "__main__":
    print("TPCOLL" + json.dumps({remat: activation_all_reduces(remat) for remat in sys.argv[1].split(",")}))
