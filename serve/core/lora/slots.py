"""The adapter slots on the device: each step's adapters are copied into slots from host memory (read
from their folders on first use), least recently used slots reused when a new adapter needs one."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfra.config import ModelConfig
from jaxinfra.models.multi_lora import LoraPools, empty_pools
from serve.core.lora.adapter_files import HostAdapter, module_shapes, read_adapter
from serve.core.sequence import Sequence
from serve.types import LoRARequest


@jax.jit
def _write_slot(pools: LoraPools, slot: jax.Array, a: dict, b: dict, scaling: jax.Array) -> LoraPools:
    """`pools` with slot `slot` holding A [L, in, R] and B [L, R, out] per projection."""
    return LoraPools(
        {m: p.at[:, slot].set(a[m].astype(p.dtype)) for m, p in pools.a.items()},
        {m: p.at[:, slot].set(b[m].astype(p.dtype)) for m, p in pools.b.items()},
        pools.scaling.at[slot].set(scaling),
    )


class AdapterSlots:
    """`num_slots` adapter slots of rank `max_rank` for projections `modules` on the device (`pools`), and
    up to `max_cpu_loras` adapters in host memory; both keyed by lora_int_id, least recently used first out."""

    def __init__(
        self, cfg: ModelConfig, num_slots: int, max_rank: int, max_cpu_loras: int, modules: tuple[str, ...]
    ) -> None:
        self.cfg, self.max_rank, self.max_cpu_loras = cfg, max_rank, max_cpu_loras
        self.shapes = {m: shape for m, shape in module_shapes(cfg).items() if m in modules}  # what the slots hold
        self.pools = empty_pools(self.shapes, cfg.num_layers, num_slots, max_rank, jnp.dtype(cfg.dtype))
        self.host: collections.OrderedDict[int, HostAdapter] = collections.OrderedDict()
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # resident adapters, LRU first
        self.free = list(range(num_slots - 1, -1, -1))
        self.loads = 0  # adapters copied into a slot so far

    def host_adapter(self, request: LoRARequest) -> HostAdapter:
        """The adapter in host memory, read from its folder if absent (a ValueError if it cannot be served)."""
        adapter = self.host.get(request.lora_int_id)
        if adapter is None or adapter.request != request:
            adapter = read_adapter(request, self.cfg, self.max_rank, tuple(self.shapes))
            self.host[request.lora_int_id] = adapter
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(request.lora_int_id)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter's host copy and free its slot (sequences still running with it reload it);
        whether it was known."""
        known = self.host.pop(lora_int_id, None) is not None
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.free.append(slot)
        return known or slot is not None

    def slots(self, seqs: list[Sequence]) -> np.ndarray:
        """Each sequence's slot (-1: no adapter), copying adapters that are not on the device into free
        slots or the least recently used ones no sequence of `seqs` needs. The scheduler admits at most
        as many adapters into the running batch as there are slots."""
        ids = [s.lora_request.lora_int_id if s.lora_request is not None else 0 for s in seqs]
        needed = set(ids) - {0}
        if len(needed) > self.pools.num_slots:
            raise RuntimeError(f"a step needs {len(needed)} adapters, more than the {self.pools.num_slots} slots")
        for seq, lora_id in zip(seqs, ids):
            if lora_id and lora_id not in self.slot_of:
                assert seq.lora_request is not None
                self._load(seq.lora_request, needed)
        for lora_id in needed:
            self.slot_of.move_to_end(lora_id)
        return np.array([self.slot_of[i] if i else -1 for i in ids], np.int32)

    def _load(self, request: LoRARequest, needed: set[int]) -> None:
        """Copy an adapter into a free slot, or the least recently used one not in `needed`."""
        adapter = self.host_adapter(request)
        if self.free:
            slot = self.free.pop()
        else:
            slot = self.slot_of.pop(next(i for i in self.slot_of if i not in needed))
        layers, r = self.cfg.num_layers, adapter.rank
        a = {m: np.zeros((layers, n_in, self.max_rank), np.float32) for m, (n_in, _) in self.shapes.items()}
        b = {m: np.zeros((layers, self.max_rank, n_out), np.float32) for m, (_, n_out) in self.shapes.items()}
        for m in adapter.a:  # projections it does not wrap stay zero: no delta
            a[m][:, :, :r], b[m][:, :r] = adapter.a[m], adapter.b[m]
        self.pools = _write_slot(self.pools, np.int32(slot), a, b, np.float32(adapter.scaling))
        self.slot_of[request.lora_int_id] = slot
        self.loads += 1
