"""LoRA training in `jaxinfra train`: only the adapters train (no optimizer state, no change for the
base weights), and the recipe configs/train/lora_kjv.yaml on the embedded model brings the held-out
loss of one book below the base model's."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

import jaxinfra
from jaxinfra.loading import DEFAULT_MODEL
from jaxinfra.lora import LoraConfig, add_lora, load_peft
from jaxinfra.train.config import load_run_config
from jaxinfra.train.logger import read_metrics
from jaxinfra.train.loop import train
from jaxinfra.train.step import TrainConfig, Trainer
from sharding import MeshConfig, get_rules, make_mesh

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

ROOT = Path(__file__).resolve().parent.parent
KJV_EXCERPT = ROOT / "tests" / "fixtures" / "kjv_excerpt.txt"


def _batch(rows=4, length=16, seed=0):
    ids = np.random.default_rng(seed).integers(0, 512, (rows, length + 1))
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": np.ones((rows, length), np.int32)}


@pytest.mark.parametrize("scan_layers", [True, False])
def test_base_is_frozen_and_has_no_optimizer_state(scan_layers):
    model = add_lora(jaxinfra.load_model("tiny-llama"), LoraConfig(4, 8.0, 0.1, ("q_proj", "down_proj")), nnx.Rngs(0))
    cfg = TrainConfig(compute_dtype="float32", scan_layers=scan_layers)
    trainer = Trainer(model, make_mesh(MeshConfig()), get_rules("fsdp"), cfg)
    state = trainer.init_state()
    before = jax.device_get(traverse_util.flatten_dict(state.params))
    # optimizer state: only the adapters' (Adam's two moments of each), nothing of the base weights
    adapter_leaves = [v for p, v in before.items() if p[-1] in ("lora_a", "lora_b")]
    moment_sizes = sorted(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
    assert moment_sizes == sorted(2 * [v.size for v in adapter_leaves])
    for seed in range(3):
        state, metrics = trainer.step(state, trainer.shard_batch(_batch(seed=seed)))
    assert np.isfinite(float(metrics["loss"]))
    after = jax.device_get(traverse_util.flatten_dict(state.params))
    for path, value in before.items():
        if path[-1] in ("lora_a", "lora_b"):
            assert not np.array_equal(after[path], value), path  # the adapters train
        else:
            np.testing.assert_array_equal(after[path], value, err_msg=str(path))  # bit-equal base


def test_lora_recipe_beats_the_base_model_on_a_held_out_book(tmp_path):
    cfg = load_run_config(
        ROOT / "configs" / "train" / "lora_kjv.yaml",
        [
            f"model={DEFAULT_MODEL}",
            f"out_dir={tmp_path}",
            f"data.paths=[{KJV_EXCERPT}]",  # every 8th chapter: 19 of the Psalms, 5 held out
            "data.valid_fraction=0.25",
            "data.seq_len=128",
            "batch_size=4",
            "steps=40",
            "eval_every=20",
        ],
    )
    tic = time.perf_counter()
    result = train(cfg, progress=False)
    evals = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl") if r["split"] == "eval"]
    print(f"LoRA recipe: held-out {evals} over {cfg.steps} steps in {time.perf_counter() - tic:.0f} s")
    assert evals[0] == (0, result.base_eval_loss) and result.eval_loss == evals[-1][1]
    assert result.eval_loss < result.base_eval_loss - 0.01, (result.base_eval_loss, result.eval_loss)
    # the exported adapter, loaded by ours on the base model, is the trained model
    model = load_peft(jaxinfra.load_model(DEFAULT_MODEL), tmp_path / "adapter")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 4096, (1, 32)), jnp.int32)
    assert not (tmp_path / "hf").exists()
    assert np.abs(np.asarray(model(ids)) - np.asarray(jaxinfra.load_model(DEFAULT_MODEL)(ids))).max() > 1e-3


SHARDED_LORA = textwrap.dedent("""
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from flax import nnx
    import jaxinfra
    from jaxinfra.lora import LoraConfig, add_lora
    from jaxinfra.train.step import Trainer, TrainConfig
    from sharding import MeshConfig, get_rules, make_mesh

    def run(mesh, preset):
        model = jaxinfra.load_model("tiny-llama")
        add_lora(model, LoraConfig(4, 8.0, 0.0, ("q_proj", "o_proj", "down_proj")), nnx.Rngs(0))
        trainer = Trainer(model, mesh, get_rules(preset), TrainConfig(compute_dtype="float32"))
        state = trainer.init_state()
        rng = np.random.default_rng(0)
        for _ in range(3):
            ids = rng.integers(0, 512, (8, 17))
            batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": np.ones((8, 16), np.int32)}
            state, metrics = trainer.step(state, trainer.shard_batch(batch))
        return state, float(metrics["loss"])

    state, loss = run(make_mesh(MeshConfig(fsdp=4, tensor=2)), "fsdp_tp")
    attn, mlp = state.params["layers"]["attn"], state.params["layers"]["mlp"]
    shard = lambda x: x.addressable_shards[0].data.shape
    assert shard(attn["q_proj"]["lora_a"]) == (2, 16, 4), shard(attn["q_proj"]["lora_a"])  # A: (embed/fsdp, r)
    assert shard(attn["q_proj"]["lora_b"]) == (2, 4, 2, 16), shard(attn["q_proj"]["lora_b"])  # B: (r, heads/tp, D)
    assert shard(attn["o_proj"]["lora_a"]) == (2, 2, 16, 4), shard(attn["o_proj"]["lora_a"])  # A: (heads/tp, D, r)
    assert shard(mlp["down_proj"]["lora_b"]) == (2, 4, 16), shard(mlp["down_proj"]["lora_b"])  # B: (r, embed/fsdp)
    one, one_loss = run(make_mesh(MeshConfig(), devices=jax.devices()[:1]), "fsdp")
    assert abs(loss - one_loss) < 1e-5, (loss, one_loss)
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(one.params))):
        np.testing.assert_allclose(a, b, atol=2e-5)
    print("ok", loss, one_loss)
""")


def test_adapters_shard_by_their_weights_axes_on_8_devices():
    r = subprocess.run([sys.executable, "-c", SHARDED_LORA], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
