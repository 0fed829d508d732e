"""Context parallelism: the sequence split over a `context` mesh axis trains exactly like one device."""

import json

import numpy as np
import pytest

from jaxinfra.models.sharded_attention import zigzag_order
from tests.check_scripts import run_check


@pytest.mark.slow
def test_context_parallel_loss_and_gradients_equal_one_device():
    """Sequence 2048 over 4 devices (K/V all-gathered per layer), with and without packed segments:
    loss and every gradient equal the unsharded model's; each device's layer activations hold a
    quarter of the sequence; a length that does not split over the axis is refused. The same with
    our flash kernel (interpret mode, sequence 512) run per device under shard_map, rows in zigzag
    order and a traced query offset per chunk, and the kernel on a 2 data x 2 tensor mesh."""
    out = run_check("tests.sharding.context_check", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert "sequence length 2046 does not split over the 4 devices" in report.pop("indivisible")
    for name, run in report.items():
        single, context = run["single"], run["context"]
        np.testing.assert_allclose(context["loss"], single["loss"], rtol=1e-5, err_msg=name)
        assert context["grads"].keys() == single["grads"].keys()
        for path, g in single["grads"].items():
            g, c = np.asarray(g), np.asarray(context["grads"][path])
            assert np.abs(g).max() > 0, (name, path)
            np.testing.assert_allclose(c, g, rtol=1e-4, atol=1e-6 * np.abs(g).max(), err_msg=f"{name} {path}")
        if name != "flash_dp_tp":
            assert context["layer_input_sharded"], name
            assert context["kv_gathers"] >= 2, name  # K and V gathered over the whole sequence


def test_zigzag_order_balances_causal_work():
    order = zigzag_order(16, 4)  # 8 chunks of 2: device i holds chunks i and 7 - i
    assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    work = [int(np.sum(order.reshape(4, 4)[d] + 1)) for d in range(4)]  # keys each device's queries see
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="does not split into 2 x 4 chunks"):
        zigzag_order(12, 4)
