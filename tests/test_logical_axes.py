"""Parameters carry logical axis names; sharding rules map them to a mesh (8 virtual CPU devices)."""

import subprocess
import sys
import textwrap

import pytest
from flax import nnx

import jaxinfra
from sharding import LOGICAL_AXES, logical_to_spec


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_every_param_names_its_axes(preset):
    model = jaxinfra.load_model(preset)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        axes = var.get_metadata()["logical_axes"]
        assert len(axes) == var.ndim and set(axes) <= set(LOGICAL_AXES), path


def test_logical_to_spec():
    rules = {"batch": ("data", "fsdp"), "embed": "fsdp", "heads": "tensor", "mlp": "tensor"}
    assert tuple(logical_to_spec(("batch", "length", "embed"), rules)) == (("data", "fsdp"), None, None)
    assert tuple(logical_to_spec(("embed", "heads", "head_dim"), rules)) == ("fsdp", "tensor", None)
    with pytest.raises(ValueError, match="unknown logical axis"):
        logical_to_spec(("embd",), rules)


SHARDED_FORWARD = textwrap.dedent("""
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import Mesh, PartitionSpec as P
    import jaxinfra
    from sharding import logical_rules, shard_state

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))
    rules = {"batch": "data", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
    model = jaxinfra.load_model("tiny-qwen2")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (4, 16)), jnp.int32)
    want = np.asarray(model(ids))
    graphdef, state = nnx.split(model)
    state = shard_state(state, mesh, rules)
    assert state["layers"][0]["mlp"]["up_proj"][...].sharding.spec == P(None, "tensor")
    with logical_rules(mesh, rules):
        got = jax.jit(lambda st, i: nnx.merge(graphdef, st)(i))(state, ids)
    assert len(got.sharding.device_set) == 8, got.sharding
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    print("ok")
""")


def test_sharded_forward_equals_single_device():
    r = subprocess.run([sys.executable, "-c", SHARDED_FORWARD], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
