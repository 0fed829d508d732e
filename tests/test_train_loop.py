"""`jaxinfra train`: bit-exact resume after the process is killed, logs (JSONL, TensorBoard, PNG),
atomic checkpoints, params-only restore, HF export, config errors."""

import json
import os
import signal
import struct
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfra.checkpoint.manager import TrainCheckpointer
from jaxinfra.loading import load_model
from jaxinfra.train.config import build_run_config, load_run_config
from jaxinfra.train.logger import read_metrics
from jaxinfra.train.loop import train
from tests.train_helpers import tiny_run_config, write_config

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out


def _run(cfg: dict):
    return train(build_run_config(json.loads(json.dumps(cfg))), progress=False)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted 24-step run."""
    tmp = tmp_path_factory.mktemp("ref")
    cfg = tiny_run_config(tmp, steps=24, **{"optim.total_steps": 24})
    return tmp, cfg, _run(cfg)


def _losses(out_dir, split="train"):
    return {r["step"]: r["loss"] for r in read_metrics(out_dir / "metrics.jsonl") if r["split"] == split}


def test_resume_after_kill_is_bit_exact(reference_run, tmp_path):
    ref_tmp, ref_cfg, _ = reference_run
    cfg = dict(ref_cfg, out_dir=str(tmp_path / "killed"))
    config = write_config(tmp_path / "run.yaml", cfg)
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxinfra", "train", "--config", str(config), "--no-progress"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        done = _losses(out) if (out / "metrics.jsonl").is_file() else {}
        if max(done, default=0) >= 14:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-2000:]
    result = train(load_run_config(config), progress=False)
    assert 3 <= result.start_step < 24  # resumed from a checkpoint, not from scratch
    assert _losses(out) == _losses(ref_tmp / "run")  # every step, bit for bit
    assert _losses(out, "eval") == _losses(ref_tmp / "run", "eval")


def test_resumed_log_windows_match_an_uninterrupted_run(tmp_path):
    """Checkpoints every 3 steps, logs every 4: a run stopped at 6 and resumed logs the same
    averaged train losses as one that ran straight to 8."""
    base = {"log_every": 4, "optim.total_steps": 8, "export_hf": False}
    straight = _run(tiny_run_config(tmp_path, out="straight", steps=8, **base))
    _run(tiny_run_config(tmp_path, out="resumed", steps=6, **base))
    resumed = _run(tiny_run_config(tmp_path, out="resumed", steps=8, **base))
    assert resumed.start_step == 6
    assert _losses(tmp_path / "resumed") == _losses(straight.out_dir)
    assert sorted(_losses(straight.out_dir)) == [3, 4, 6, 8]


def test_profile_steps_write_a_trace_for_tensorboard(tmp_path):
    """profile_steps=2 from step 1: a jax.profiler trace under out_dir/tb/plugins/profile."""
    result = _run(tiny_run_config(tmp_path, steps=4, profile_steps=2, profile_start=1, export_hf=False))
    traces = list((result.out_dir / "tb" / "plugins" / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 1000


def _tensorboard_scalars(tb_dir):
    """Parse TFRecord event files with tensorboardX's protobuf definitions."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for f in sorted(p for p in tb_dir.iterdir() if p.is_file()):
        data = f.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                scalars[(v.tag, event.step)] = v.simple_value
    return scalars


def test_logs_checkpoints_and_exports(reference_run):
    tmp, _, result = reference_run
    out = tmp / "run"
    records = read_metrics(out / "metrics.jsonl")
    train_records = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train_records] == list(range(1, 25))
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "state_gib"} <= set(train_records[0])
    assert train_records[-1]["loss"] < train_records[0]["loss"]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [5, 10, 15, 20, 24] and result.eval_loss == evals[-1]["loss"]
    scalars = _tensorboard_scalars(out / "tb")
    for r in train_records:
        assert scalars[("train/loss", r["step"])] == pytest.approx(r["loss"], rel=1e-6)
    assert scalars[("eval/perplexity", 24)] == pytest.approx(np.exp(evals[-1]["loss"]), rel=1e-5)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert TrainCheckpointer(out / "checkpoints").all_steps() == [21, 24]  # keep=2
    # params-only restore of the run directory == the exported HF folder
    ids = jnp.asarray([[256, 72, 101, 108, 108, 111]])
    np.testing.assert_array_equal(np.asarray(load_model(out)(ids)), np.asarray(load_model(out / "hf")(ids)))


def test_training_continues_from_an_hf_export_or_a_run_directory(reference_run, tmp_path):
    tmp, cfg, _ = reference_run
    first_loss = _losses(tmp / "run")[1]
    for i, model in enumerate((tmp / "run" / "hf", tmp / "run")):
        result = _run(dict(cfg, model=str(model), out_dir=str(tmp_path / f"ft{i}"), steps=2, export_hf=False))
        assert result.start_step == 0
        # the same first batch as the reference run's step 1, on trained rather than random weights
        assert _losses(tmp_path / f"ft{i}")[1] < first_loss - 1.0


def test_interrupted_save_never_hides_the_last_good_checkpoint(reference_run, tmp_path):
    import shutil

    tmp, _, _ = reference_run
    ckpt_dir = tmp_path / "checkpoints"
    shutil.copytree(tmp / "run" / "checkpoints", ckpt_dir)
    partial = ckpt_dir / "27.orbax-checkpoint-tmp-1764460000000000"  # a save killed mid-write
    (partial / "params").mkdir(parents=True)
    (partial / "params" / "garbage").write_bytes(b"\0" * 100)
    manager = TrainCheckpointer(ckpt_dir)
    assert manager.latest_step() == 24 and 27 not in manager.all_steps()
    manager.close()
    ids = jnp.asarray([[256, 72, 101]])
    run = tmp_path / "run"
    shutil.copytree(tmp / "run" / "model", run / "model")
    shutil.move(ckpt_dir, run / "checkpoints")
    np.testing.assert_array_equal(np.asarray(load_model(run)(ids)), np.asarray(load_model(tmp / "run" / "hf")(ids)))


def test_every_recipe_loads():
    from pathlib import Path

    recipes = sorted((Path(__file__).parent.parent / "configs" / "train").glob("*.yaml"))
    assert len(recipes) >= 4
    for recipe in recipes:
        cfg = load_run_config(recipe)
        assert cfg.optim.total_steps == cfg.steps and cfg.data.paths, recipe


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="optim.lr"):
        load_run_config(None, ["optim.lr=1"])
    with pytest.raises(ValueError, match="sharding"):
        load_run_config(None, ["sharding=zero9"])
    with pytest.raises(ValueError, match="data.seq_len"):
        load_run_config(None, ["data.seq_len=1"])
    with pytest.raises(ValueError, match="steps"):
        load_run_config(None, ["steps=0"])
    cfg = load_run_config(None, ["optim.learning_rate=1e-3", "steps=7"])
    assert cfg.optim.learning_rate == 1e-3 and cfg.optim.total_steps == 7
    with pytest.raises(ValueError, match="data.paths"):
        train(load_run_config(None, [f"out_dir={tmp_path}"]), progress=False)
    with pytest.raises(ValueError, match="vocab_size"):
        bad = tiny_run_config(tmp_path, tokenizer=None, model="tiny-llama")
        bad["model"] = str(tmp_path / "small.yaml")
        (tmp_path / "small.yaml").write_text(
            "vocab_size: 100\nhidden_size: 32\nintermediate_size: 64\nnum_layers: 1\nnum_heads: 2\nnum_kv_heads: 2\n"
        )
        _run(bad)
