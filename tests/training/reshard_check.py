"""Save a training checkpoint on mesh (8,1,1) with `fsdp`, restore it on (2,2,2) with `fsdp_tp` (and
on one device); print whether params and the next loss agree. Runs on 8 virtual CPU devices."""

import json
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxinfra.checkpoint.manager import TrainCheckpointer  # noqa: E402
from jaxinfra.config import ModelConfig  # noqa: E402
from jaxinfra.data import DataConfig, DataLoader, load_documents  # noqa: E402
from jaxinfra.models import LlamaModel  # noqa: E402
from jaxinfra.tokenizer import Tokenizer  # noqa: E402
from jaxinfra.train import OptimConfig, TrainConfig, Trainer  # noqa: E402
from sharding import MeshConfig, get_rules, make_mesh  # noqa: E402
from tests.train_helpers import write_corpus  # noqa: E402

tmp = Path(tempfile.mkdtemp())
docs = load_documents([write_corpus(tmp / "corpus.txt")])
data_cfg = DataConfig(seq_len=32, packing_bins=4)
cfg = ModelConfig(
    vocab_size=264,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    initializer_range=0.05,
)
optim = TrainConfig(OptimConfig(warmup_steps=1, total_steps=10, learning_rate=1e-2), compute_dtype="float32")
model = LlamaModel(cfg, nnx.Rngs(0))


def trainer_on(mesh: tuple[int, int, int], preset: str) -> Trainer:
    return Trainer(model, make_mesh(MeshConfig(*mesh), jax.devices()[: int(np.prod(mesh))]), get_rules(preset), optim)


saver = trainer_on((8, 1, 1), "fsdp")
data = DataLoader(data_cfg, Tokenizer.byte_level(), 8, "train", docs)
state = saver.init_state()
for _ in range(3):
    state, _ = saver.step(state, saver.place_local_batch(next(data), 8))
ckpt = TrainCheckpointer(tmp / "ckpt")
ckpt.save(3, state.params, state.opt_state, data)
ckpt.wait()
batch = next(data)
saved_params = jax.device_get(state.params)
_, ref = saver.step(state, saver.place_local_batch(batch, 8))
report = {"reference_loss": float(ref["loss"])}
for mesh, preset in (((2, 2, 2), "fsdp_tp"), ((1, 1, 1), "dp")):
    trainer = trainer_on(mesh, preset)
    target = trainer.abstract_state()
    restored_data = DataLoader(data_cfg, Tokenizer.byte_level(), 8, "train", docs)
    params, opt_state = ckpt.restore(3, target.params, target.opt_state, restored_data)
    got = jax.tree.leaves(jax.device_get(params))
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(saved_params), got))
    layout = jax.tree.leaves(params)[0].sharding.spec  # the restored arrays carry the new layout
    next_batch = next(restored_data)
    same_batch = all(np.array_equal(next_batch[k], batch[k]) for k in batch)
    restored = type(state)(np.int32(3), params, opt_state)
    restored = jax.device_put(restored, trainer.state_shardings)
    _, m = trainer.step(restored, trainer.place_local_batch(next_batch, 8))
    report[f"{preset}{mesh}"] = {
        "params_identical": same,
        "same_next_batch": same_batch,
        "next_loss": float(m["loss"]),
        "spec": str(layout),
    }
print("RESHARD" + json.dumps(report))
