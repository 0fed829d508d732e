"""Sharded training on 8 virtual CPU devices equals one device, for every preset on the mesh shapes that
exercise its axes (`sharding_meshes.MESHES`)."""

import json
import subprocess
import sys

import pytest

from sharding import MeshConfig, get_rules
from tests.check_scripts import ROOT, run_check
from tests.sharding_meshes import MESHES

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

PRESETS = list(MESHES)


@pytest.fixture(scope="module")
def report():
    """Two subprocesses (one per core), half of the presets each, merged."""
    groups = [PRESETS[:3], PRESETS[3:]]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.sharding.sharded_checks", ",".join(g)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for g in groups
    ]
    merged = None
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
        part = json.loads(next(x for x in out.splitlines() if x.startswith("REPORT"))[len("REPORT") :])
        if merged is None:
            merged = part
        else:
            merged["runs"] += part["runs"]
            merged["plan"] += part["plan"]
            merged["tp_without_tensor_axis"] += part["tp_without_tensor_axis"]
    return merged


def test_loss_gradients_and_curve_match_single_device(report):
    assert {(r["preset"], tuple(r["mesh"])) for r in report["runs"]} == {
        (preset, mesh) for preset, meshes in MESHES.items() for mesh in meshes
    }
    for run in report["runs"]:
        where = f"{run['preset']} on {run['mesh']}"
        assert run["loss_rel_err"] <= 1e-5, where
        assert run["grad_rel_err"] <= 1e-5, where
        assert run["curve_rel_err"] <= 1e-5, where  # 20 AdamW steps
    assert report["ref_losses"][-1] < 0.5 * report["ref_losses"][0]  # the curve really moves


def test_memory_per_device(report):
    def mem(preset, mesh=(8, 1, 1)):
        return next(r["memory"] for r in report["runs"] if r["preset"] == preset and tuple(r["mesh"]) == mesh)

    dp, zero1, fsdp = mem("dp"), mem("zero1"), mem("fsdp")
    assert fsdp["params"] + fsdp["opt"] <= (dp["params"] + dp["opt"]) / 7
    assert zero1["params"] == dp["params"]
    assert abs(zero1["opt"] / dp["opt"] - 1 / 8) < 0.01  # the optimizer's step counter stays replicated
    tp = mem("tp", (1, 1, 8))
    assert tp["params"] < dp["params"] / 7


def test_plan_report_matches_arrays_and_zero_accounting(report):
    for row in report["plan"]:
        actual = next(
            r["memory"] for r in report["runs"] if r["preset"] == row["preset"] and tuple(r["mesh"]) == (8, 1, 1)
        )
        assert row["params"] == actual["params"] and row["optimizer"] == actual["opt"], row["preset"]
        for part in ("params", "grads", "optimizer"):
            # analytic ignores that tiny vectors (norms) and the Adam step counter stay replicated
            assert abs(row[part] - row[f"analytic_{part}"]) <= 0.05 * row[f"analytic_{part}"] + 2048, (row, part)
        assert row["activations"] > 0 and row["xla_temp"] > 0
    assert "shards over the tensor axis" in report["tp_without_tensor_axis"]  # not silently dp numbers


def test_collectives_in_compiled_steps(report):
    def run(preset, mesh):
        return next(r for r in report["runs"] if r["preset"] == preset and tuple(r["mesh"]) == mesh)

    tp = run("tp", (1, 1, 8))
    assert tp["all_reduce"] >= 2 * 2 and tp["all_gather"] == 0  # >= one per attention and per MLP, 2 layers
    fsdp = run("fsdp", (1, 8, 1))
    assert fsdp["all_gather"] >= 2 * 7  # weights gathered per layer and per matrix, not in one lump
    dp = run("dp", (8, 1, 1))
    assert dp["all_reduce"] >= 1  # gradients summed over the data axis
    assert dp["all_gather"] == 0  # strided microbatches stay spread over every device


def test_microbatches_that_cannot_spread_over_the_devices_are_refused(report):
    assert "microbatches=2" in report["indivisible_refused"] and "multiple of 8" in report["indivisible_refused"]


def test_mesh_config_and_presets():
    # AXES: pipeline, data, fsdp, expert, context, tensor
    assert MeshConfig(-1, 2, 2).shape(8) == (1, 2, 2, 1, 1, 2)
    assert MeshConfig(1, -1, 1).shape(8) == (1, 1, 8, 1, 1, 1)
    assert MeshConfig(-1, pipeline=4, context=1).shape(8) == (4, 2, 1, 1, 1, 1)
    assert MeshConfig(-1, expert=4).shape(8) == (1, 2, 1, 4, 1, 1)
    with pytest.raises(ValueError, match="not divisible"):
        MeshConfig(-1, 3, 1).shape(8)
    with pytest.raises(ValueError, match="needs 4 devices"):
        MeshConfig(2, 2, 1).shape(8)
    with pytest.raises(ValueError, match="unknown sharding preset"):
        get_rules("zero4")


def test_tensor_parallel_serving_matches_one_device():
    r = run_check("tests.sharding.tp_serving_check", timeout=600)
    assert r.returncode == 0 and "TP_OK" in r.stdout, r.stderr[-3000:]


def test_tensor_parallel_step_has_megatron_all_reduces():
    """Scanned layers under tp (4 data x 2 tensor): the forward layer body reduces activations twice
    (after attention, after the MLP) and the backward body twice (the input gradients of the fused
    Q/K/V and gate/up matmuls), as in Megatron; with full remat the backward body also recomputes the
    attention output's reduction (the MLP's is not needed to get the layer's gradients)."""
    out = run_check("tests.sharding.tp_collectives_check", "none,full", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    counts = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("TPCOLL"))[len("TPCOLL") :])
    assert sorted(counts["none"].values()) == [2, 2], counts
    assert sorted(counts["full"].values()) == [2, 3], counts
