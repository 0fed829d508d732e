"""Expert parallelism on 8 virtual CPU devices: the same training as on one device, with tokens
exchanged by all-to-all and expert weights never gathered."""

import json

import numpy as np
import pytest

from sharding import MeshConfig, get_rules
from tests.check_scripts import run_check


@pytest.mark.slow
def test_expert_parallel_training_equals_one_device():
    out = run_check("tests.sharding.expert_parallel_check", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    np.testing.assert_allclose(report["ep_losses"], report["single_losses"], rtol=1e-5)
    np.testing.assert_array_equal(report["ep_loads"], report["single_loads"])  # same routing every step
    assert report["single_losses"][-1] < report["single_losses"][0]
    assert report["all_to_all"] >= 4  # per MoE layer: tokens out and back, forward and backward
    assert report["expert_weight_gathers"] == []


def test_expert_mesh_axis_and_preset():
    assert MeshConfig(data=2, expert=4).shape(8) == (1, 2, 1, 4, 1, 1)
    assert get_rules("ep").params["experts"] == "expert"
    assert "expert" in get_rules("ep").activations["batch"]
