"""Multi-LoRA in the forward pass: each token's adapter delta on the projections its adapter wraps,
read from adapter slot pools (serving's multi-LoRA; the pools and slots are pallas_kernels.lora's)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import lora_apply


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraPools:
    """Adapter slots on the device, for every decoder layer: per projection (HF's name) A [L, S, in, R]
    and B [L, S, R, out] (ranks below R zero-padded), and each slot's scaling (alpha / rank) [S]."""

    a: dict[str, Float[Array, "L S IN R"]]
    b: dict[str, Float[Array, "L S R OUT"]]
    scaling: Float[Array, " S"]

    @property
    def num_slots(self) -> int:
        return int(self.scaling.shape[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MultiLora:
    """One forward pass's adapters: the slot of each token of the flat batch (-1: the base model)
    and the pools, stacked over layers until `layer` picks one layer's."""

    slots: Int[Array, " N"]
    pools: LoraPools

    def layer(self, i: Int[Array, ""] | int) -> MultiLora:
        """The pools of decoder layer `i`: A [S, in, R] and B [S, R, out] per projection."""
        pick = lambda p: {m: w[i] for m, w in p.items()}
        return MultiLora(self.slots, LoraPools(pick(self.pools.a), pick(self.pools.b), self.pools.scaling))

    def add(self, module: str, x: Float[Array, "B T ..."], y: Float[Array, "B T ..."]) -> Float[Array, "B T ..."]:
        """y (x's projection by the base weight of `module`) plus each token's adapter delta; y itself
        for a projection no pool holds. x and y are flattened past their two leading (batch, length) dims."""
        if module not in self.pools.a:
            return y
        n = x.shape[0] * x.shape[1]
        delta = lora_apply(
            x.reshape(n, -1), self.pools.a[module], self.pools.b[module], self.pools.scaling, slots=self.slots
        )
        return y + delta.reshape(y.shape).astype(y.dtype)


def maybe_add(lora: MultiLora | None, module: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """`lora.add(module, x, y)`, or y without adapters."""
    return y if lora is None else lora.add(module, x, y)


def empty_pools(
    shapes: dict[str, tuple[int, int]], num_layers: int, num_slots: int, rank: int, dtype: jnp.dtype
) -> LoraPools:
    """Zeroed pools for projections of (in, out) sizes `shapes`: every slot holds no adapter."""
    a = {m: jnp.zeros((num_layers, num_slots, i, rank), dtype) for m, (i, _) in shapes.items()}
    b = {m: jnp.zeros((num_layers, num_slots, rank, o), dtype) for m, (_, o) in shapes.items()}
    return LoraPools(a, b, jnp.zeros((num_slots,), jnp.float32))
