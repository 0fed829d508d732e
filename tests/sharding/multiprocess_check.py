"""One process of a 2-process x 4-CPU-device run (jax.distributed on localhost); prints its losses.

Also runnable as a single process over 8 devices (argv: single) for the reference curve."""

import json
import sys

import jax

mode = sys.argv[1]
if mode == "single":
    jax.config.update("jax_num_cpu_devices", 8)
else:
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from sharding import initialize_distributed
    initialize_distributed(f"127.0.0.1:{sys.argv[2]}", num_processes=2, process_id=int(mode))

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxinfra.config import ModelConfig  # noqa: E402
from jaxinfra.models import LlamaModel  # noqa: E402
from jaxinfra.train import TrainConfig, Trainer  # noqa: E402
from sharding import MeshConfig, get_rules, make_mesh  # noqa: E402

cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=8,
                  head_dim=8, initializer_range=0.1)
trainer = Trainer(LlamaModel(cfg, nnx.Rngs(0)), make_mesh(MeshConfig(2, 4, 1)), get_rules("fsdp"),
                  TrainConfig(compute_dtype="float32", warmup_steps=2, total_steps=10, learning_rate=1e-2))
state = trainer.init_state()
ids = np.random.default_rng(0).integers(0, 256, (8, 17))
batch = trainer.shard_batch(dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=np.ones((8, 16), np.int32)))
losses = []
for _ in range(8):
    state, m = trainer.step(state, batch)
    losses.append(float(m["loss"]))
print("LOSSES" + json.dumps({"process": jax.process_index(), "count": jax.process_count(),
                             "devices": jax.device_count(), "losses": losses}))
