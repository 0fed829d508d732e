"""Run on 8 virtual CPU devices (a subprocess of test_kv_transfer.py): blocks moved from a prefill
mesh (4 devices) to a decode mesh (2 devices) equal the source bitwise, bf16 and int8 KV. Prints DEVICE_OK."""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from serve.kv_transfer.device_transport import carve_meshes, place_pool, transfer_blocks  # noqa: E402
from tests.kv_transfer.pools import blocks_of, random_pool  # noqa: E402

prefill, decode = carve_meshes(4, 2)
for kind in ("bf16", "int8"):
    src = place_pool(random_pool(kind, 0), prefill)
    dst = place_pool(random_pool(kind, 1), decode)
    untouched = blocks_of(dst, [0, 2, 4, 6, 7])
    src_ids, dst_ids = [6, 1, 3], [5, 1, 3]
    expected = blocks_of(src, src_ids)
    dst = transfer_blocks(src, src_ids, dst, dst_ids)
    assert set(dst.k.sharding.device_set) == set(decode.devices.flat), kind
    got = blocks_of(dst, dst_ids)
    assert expected.keys() == got.keys() == ({"k", "v"} if kind == "bf16" else {"k", "v", "k_scale", "v_scale"})
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])
        np.testing.assert_array_equal(blocks_of(dst, [0, 2, 4, 6, 7])[name], untouched[name])
print("DEVICE_OK")
