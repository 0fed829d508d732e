"""Run on 4 virtual CPU devices (a subprocess of test_context_parallel.py): context parallelism (the
sequence split over 4 devices) against one device, sequence 2048, with and without segment ids."""

import json
import re
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)

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
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    initializer_range=0.1,
)
SEQ = 2048


def batch(segments: bool, seq: int = SEQ, rows: int = 2) -> dict:
    rng = np.random.default_rng(1)
    ids = rng.integers(0, CFG.vocab_size, (rows, seq + 1))
    out = dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=(rng.random((rows, seq)) < 0.9).astype(np.int32))
    if segments:  # packed documents of random lengths (about 8 per row), positions restarting in each
        seg = np.cumsum(rng.random((rows, seq)) < 8 / seq, axis=1).astype(np.int32)
        pos = np.zeros_like(seg)
        for r in range(rows):
            for t in range(1, seq):
                pos[r, t] = 0 if seg[r, t] != seg[r, t - 1] else pos[r, t - 1] + 1
        out.update(segment_ids=seg, positions=pos)
    return out


def run(mesh: MeshConfig, devices: int, segments: bool, impl: str = "reference", seq: int = SEQ) -> dict:
    cfg = TrainConfig(OptimConfig(warmup_steps=1, total_steps=10), compute_dtype="float32")
    model = LlamaModel(CFG, nnx.Rngs(0), impl)
    trainer = Trainer(model, make_mesh(mesh, jax.devices()[:devices]), get_rules("fsdp"), cfg)
    state = trainer.init_state()
    b = placed(trainer, batch(segments, seq))
    loss, grads = trainer.gradients(state, b)
    hlo = trainer.step.lower(state, b).compile().as_text()
    gathers = re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo)
    return {
        "loss": float(loss),
        "grads": {"/".join(map(str, k)): np.asarray(v).tolist() for k, v in flat(grads)},
        "layer_input_sharded": f"f32[2,{seq // 4},32]" in hlo,  # a quarter of the sequence per device
        "kv_gathers": sum(f",{seq}," in g for g in gathers),
    }


def indivisible() -> str:
    """The error for a sequence that does not split over the context axis."""
    cfg = TrainConfig(compute_dtype="float32")
    mesh = make_mesh(MeshConfig(data=1, context=4), jax.devices()[:4])
    trainer = Trainer(LlamaModel(CFG, nnx.Rngs(0)), mesh, get_rules("fsdp"), cfg)
    b = batch(False)
    b = {k: v[:, :2046] for k, v in b.items()}
    try:
        trainer.gradients(trainer.init_state(), placed(trainer, b))
    except ValueError as e:
        return str(e)
    return "no error"


def flat(tree: dict, prefix: tuple = ()) -> list:
    items = []
    for k, v in tree.items():
        items += flat(v, (*prefix, k)) if isinstance(v, dict) else [((*prefix, k), v)]
    return items


def main() -> None:
    report = {}
    for segments in (False, True):
        name = "segments" if segments else "plain"
        single, context = run(MeshConfig(data=1), 1, segments), run(MeshConfig(data=1, context=4), 4, segments)
        report[name] = {"single": single, "context": context}
        # our flash kernel (interpret mode) per device under shard_map, sequence 512 over 4 devices
        single = run(MeshConfig(data=1), 1, segments, "reference", 512)
        report[f"flash_{name}"] = {
            "single": single,
            "context": run(MeshConfig(data=1, context=4), 4, segments, "pallas", 512),
        }
    single = report["flash_segments"]["single"]  # flash per device under data x tensor, same batch
    report["flash_dp_tp"] = {"single": single, "context": run(MeshConfig(data=2, tensor=2), 4, True, "pallas", 512)}
    report["indivisible"] = indivisible()
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
