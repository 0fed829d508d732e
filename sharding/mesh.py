"""Device meshes with axes (pipeline, data, fsdp, expert, context, tensor) from a small config; -1
fills the remaining devices."""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("pipeline", "data", "fsdp", "expert", "context", "tensor")  # outermost (across hosts) to innermost


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes: data and fsdp split the batch (fsdp also the weights), tensor the heads
    and MLP, pipeline the decoder layers into stages, context the sequence, expert a mixture of
    experts' experts (and the batch: tokens travel to their experts' devices and back)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1

    def shape(self, num_devices: int) -> tuple[int, ...]:
        """The axis sizes in AXES order."""
        sizes = [getattr(self, a) for a in AXES]
        if sizes.count(-1) > 1:
            raise ValueError(f"MeshConfig: at most one axis may be -1, got {sizes}")
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError(f"MeshConfig: axis sizes must be positive or -1, got {sizes}")
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(f"MeshConfig {sizes}: {num_devices} devices are not divisible by {known}")
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(f"MeshConfig {sizes} needs {math.prod(sizes)} devices, have {num_devices}")
        return tuple(sizes)


def make_mesh(config: MeshConfig = MeshConfig(), devices: list[jax.Device] | None = None) -> Mesh:
    """A mesh over AXES. Devices are ordered by process, so across hosts the outer pipeline and data
    axes span processes and fsdp/context/tensor stay inside a host's fast interconnect."""
    devices = list(devices if devices is not None else jax.devices())
    devices.sort(key=lambda d: (d.process_index, d.id))
    shape = config.shape(len(devices))
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def initialize_distributed(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
    """jax.distributed from flags, else from JAXINFRA_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID."""
    coordinator = coordinator or os.environ.get("JAXINFRA_COORDINATOR")
    if coordinator is None:
        return
    num_processes = num_processes or int(os.environ["JAXINFRA_NUM_PROCESSES"])
    process_id = process_id if process_id is not None else int(os.environ["JAXINFRA_PROCESS_ID"])
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


def tensor_parallel_mesh(size: int, num_kv_heads: int, expert_parallel_size: int = 1, context: int = 1) -> Mesh:
    """A serving mesh: one tensor-parallel group of the first `size` devices (KV heads split over it);
    with expert parallelism over more devices, that group repeated along the expert axis (the experts
    split over expert x tensor, everything else replicated over expert); with `context` > 1, repeated
    along the context axis (a step's tokens split over it, weights and KV pools replicated)."""
    devices = max(size, expert_parallel_size) * context
    if devices > len(jax.devices()):
        raise ValueError(
            f"{devices} devices needed for tensor/expert/context parallelism; {len(jax.devices())} available"
        )
    if num_kv_heads % size:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must be divisible by tensor_parallel_size ({size})")
    if devices // context % size:
        raise ValueError(f"expert_parallel_size ({expert_parallel_size}) must be a multiple of tensor_parallel_size")
    config = MeshConfig(data=1, fsdp=1, expert=devices // context // size, context=context, tensor=size)
    return make_mesh(config, jax.devices()[:devices])


def parallel_sizes(mesh: Mesh) -> tuple[int, int]:
    """(data-parallel ranks, tensor-parallel ranks) of a mesh over AXES."""
    return mesh.shape["data"] * mesh.shape["fsdp"], mesh.shape["tensor"]
