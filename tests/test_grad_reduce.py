"""Weight gradients cross the devices in float32 under bfloat16 compute (grad_reduce_dtype)."""

import json

import numpy as np
import pytest

from jaxinfra.train import TrainConfig
from tests.check_scripts import run_check


@pytest.mark.slow
def test_gradients_are_reduced_in_float32_unless_asked_otherwise():
    """An fsdp step (2 data x 4 fsdp) with bfloat16 compute and 2 microbatches, read right after
    SPMD partitioning: with grad_reduce_dtype=float32 no reduction is bfloat16; with `compute` the
    weight gradients are summed in bfloat16. Loss and gradients agree between the two."""
    out = run_check("tests.sharding.grad_reduce_check", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    for preset in ("fsdp",):
        master, compute = report[f"{preset}/float32"], report[f"{preset}/compute"]
        assert not [k for k in master["counts"] if k.endswith("bf16")], master["counts"]
        assert compute["counts"].get("all-reduce bf16", 0) + compute["counts"].get("reduce-scatter bf16", 0) > 0
        np.testing.assert_allclose(master["loss"], compute["loss"], rtol=1e-3)
        for a, b in zip(master["grads"], compute["grads"], strict=True):
            a, b = np.asarray(a), np.asarray(b)
            assert np.linalg.norm(a - b) <= 0.05 * np.linalg.norm(a), preset


def test_grad_reduce_dtype_is_checked():
    with pytest.raises(ValueError, match="grad_reduce_dtype"):
        TrainConfig(grad_reduce_dtype="bf16")
