"""The (data, fsdp, tensor) meshes each sharding preset is checked on against one device: those whose
axes the preset shards over (every data-parallel preset splits the batch over data and fsdp alike),
and the mixed 2 x 2 x 2 mesh for all of them."""

MESHES = {
    "dp": [(8, 1, 1), (2, 2, 2)],
    "zero1": [(8, 1, 1), (2, 2, 2)],
    "zero2": [(8, 1, 1), (2, 2, 2)],
    "fsdp": [(8, 1, 1), (1, 8, 1), (2, 2, 2)],
    "tp": [(1, 1, 8), (2, 2, 2)],
    "fsdp_tp": [(1, 1, 8), (2, 2, 2)],
}


def placed(trainer, batch: dict) -> dict:
    """A host batch on the mesh the way `jaxinfra train` puts it there (Trainer.place_local_batch; this
    one process holds every row), so the sharded checks run the production batch path. One device's
    reference run takes `on_one_device` instead: a bug in the placement then shows as a difference."""
    import numpy as np

    if len(trainer.mesh.devices.flat) == 1:
        return on_one_device(batch)
    rows = {k: np.asarray(v) for k, v in batch.items()}
    return trainer.place_local_batch(rows, len(rows["input_ids"]))


def on_one_device(batch: dict) -> dict:
    """The reference's batch: the host arrays on the default device, with no placement logic at all."""
    import jax.numpy as jnp

    return {k: jnp.asarray(v) for k, v in batch.items()}
