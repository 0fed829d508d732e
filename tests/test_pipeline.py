"""Pipeline parallelism: the schedule's arithmetic, its errors, and (on 8 virtual CPU devices) GPipe
and circular training equal to the same model trained without a pipeline."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from jaxinfra.config import ModelConfig
from jaxinfra.models import LlamaModel
from jaxinfra.train import TrainConfig, Trainer
from jaxinfra.train.pipeline import PipelineSchedule
from jaxinfra.train.step import ModelDef, pipeline_schedule
from sharding import MeshConfig, get_rules, make_mesh
from tests.check_scripts import run_check


@pytest.mark.parametrize(("stages", "micro", "repeats"), [(4, 4, 1), (4, 8, 1), (2, 1, 1), (4, 4, 2), (3, 5, 3)])
def test_bubble_counted_from_the_schedule_matches_the_formula(stages, micro, repeats):
    schedule = PipelineSchedule(stages, micro, repeats)
    assert schedule.bubble_fraction() == pytest.approx((stages - 1) / (micro * repeats + stages - 1))
    busy = schedule.busy()
    assert busy.sum(axis=0).tolist() == [micro * repeats] * stages  # every stage does every unit once


def test_bad_pipeline_settings_are_refused():
    with pytest.raises(ValueError, match="microbatches >= pipeline stages"):
        PipelineSchedule(4, 2, 2)
    with pytest.raises(ValueError, match="6 decoder layers do not split into 4 pipeline stages"):
        PipelineSchedule(4, 4).check_layers(6)
    with pytest.raises(ValueError, match="pipeline_schedule"):
        TrainConfig(pipeline_schedule="1f1b")
    with pytest.raises(ValueError, match="pipeline_repeats"):
        TrainConfig(pipeline_schedule="circular", pipeline_repeats=1)


def test_pipeline_needs_scanned_layers():
    cfg = ModelConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=4, num_heads=2, num_kv_heads=2, head_dim=8
    )
    model = LlamaModel(cfg, nnx.Rngs(0))
    one_device = make_mesh(MeshConfig(data=1), jax.devices()[:1])
    assert Trainer(model, one_device, get_rules("dp"), TrainConfig()).pipeline is None
    two_stages = AbstractMesh((2,), ("pipeline",))
    with pytest.raises(ValueError, match="needs scan_layers=True"):
        pipeline_schedule(two_stages, TrainConfig(scan_layers=False), ModelDef(model, scan_layers=False))
    schedule = pipeline_schedule(two_stages, TrainConfig(microbatches=3), ModelDef(model, scan_layers=True))
    assert schedule == PipelineSchedule(stages=2, microbatches=3, repeats=1)


@pytest.mark.slow
def test_pipeline_trains_like_no_pipeline():
    """4 stages x 2 data on 8 devices, 4 microbatches, 8 layers, packed rows with segment ids: 20 steps
    of GPipe, circular (2 repeats), GPipe with fsdp + full remat and circular with 2-way tensor
    parallelism give the loss curve of 2-way data parallelism without a pipeline (rtol 1e-5); each
    device holds only its stage's layers."""
    out = run_check("tests.sharding.pipeline_check", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    reference = report.pop("reference")
    assert reference["losses"][-1] < reference["losses"][0] - 1.0  # it trains
    for name, run in report.items():
        np.testing.assert_allclose(run["losses"], reference["losses"], rtol=1e-5, err_msg=name)
        assert run["layer_shard"][0] == 2, name  # 8 layers over 4 stages
        assert run["collective_permutes"] > 0, name  # activations move stage to stage
    assert report["gpipe"]["bubble"] == pytest.approx(3 / 7)  # (P - 1) / (M + P - 1), P = M = 4
    assert report["circular"]["bubble"] == pytest.approx(3 / 11)  # (P - 1) / (2M + P - 1)
