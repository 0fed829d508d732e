"""Training across meshes and processes: a checkpoint saved under one layout restores under another;
`jaxinfra train` as 2 processes x 4 CPU devices (jax.distributed, localhost) equals 1 process x 8."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxinfra.train.logger import read_metrics
from tests.check_scripts import run_check
from tests.train_helpers import tiny_run_config, write_config

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

HERE = Path(__file__).parent


def test_checkpoint_restores_onto_other_mesh_and_preset():
    out = run_check("tests.training.reshard_check", timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESHARD")), None)
    assert line, out.stderr[-3000:]
    report = json.loads(line[len("RESHARD") :])
    for key in ("fsdp_tp(2, 2, 2)", "dp(1, 1, 1)"):
        assert report[key]["params_identical"] and report[key]["same_next_batch"], report
        np.testing.assert_allclose(report[key]["next_loss"], report["reference_loss"], rtol=1e-6)
    assert "tensor" in report["fsdp_tp(2, 2, 2)"]["spec"]


def test_two_processes_train_like_one_process(tmp_path):
    cfg = tiny_run_config(
        tmp_path,
        steps=6,
        batch_size=8,
        sharding="fsdp",
        mesh={"data": 2, "fsdp": 4, "tensor": 1},
        **{"data.shards": 2, "checkpoint.every": 3, "eval_every": 3},
    )
    config = write_config(tmp_path / "run.yaml", cfg)
    base = [sys.executable, "-m", "jaxinfra", "train", "--config", str(config), "--no-progress", "--devices"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = [
        subprocess.Popen(
            base
            + [
                "4",
                f"out_dir={tmp_path / 'two'}",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    one = subprocess.run(base + ["8", f"out_dir={tmp_path / 'one'}"], capture_output=True, text=True, timeout=600)
    outs = [p.communicate(timeout=600) for p in two]
    assert one.returncode == 0, one.stderr[-3000:]
    for p, (_, err) in zip(two, outs):
        assert p.returncode == 0, err[-3000:]
    ref, got = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("one", "two"))
    assert [(r["step"], r["split"]) for r in got] == [(r["step"], r["split"]) for r in ref]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints" / "6" / "data").iterdir()) == [
        "commit_success.txt",
        "process_0-of-2.json",
        "process_1-of-2.json",
    ]
    ref_w, got_w = (load_file(tmp_path / d / "hf" / "model.safetensors") for d in ("one", "two"))
    for name in ref_w:
        np.testing.assert_allclose(got_w[name], ref_w[name], rtol=1e-4, atol=1e-6)
