"""Multi-LoRA in the forward pass: each token's adapter delta on the projections its adapter wraps,
read from adapter slot pools (serving's multi-LoRA; the pools and slots are pallas_kernels.lora's)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

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
    """One forward pass's adapters: the slot of each token of the flat batch (-1: the base model), the
    pools stacked over layers, whether any token has an adapter (computed once per step by `of`: without
    one, every projection skips the adapter math), and the decoder layer `layer` picked (None: none yet)."""

    slots: Int[Array, " N"]
    pools: LoraPools
    active: Bool[Array, ""]
    layer_index: Int[Array, ""] | int | None = None

    @classmethod
    def of(cls, slots: Int[Array, " N"], pools: LoraPools) -> MultiLora:
        """The adapters of a step whose tokens use `slots`."""
        return cls(slots, pools, jnp.any(slots >= 0))

    def layer(self, i: Int[Array, ""] | int) -> MultiLora:
        """These adapters in decoder layer `i`. The pools stay stacked: a layer's slice (a copy) is taken
        only in steps that use it, so a step without adapters never copies the pools."""
        return dataclasses.replace(self, layer_index=i)

    def add(self, module: str, x: Float[Array, "B T ..."], y: Float[Array, "B T ..."]) -> Float[Array, "B T ..."]:
        """y (x's projection by the base weight of `module` in the picked layer) plus each token's adapter
        delta; y itself for a projection no pool holds, or when no token has an adapter (the pools are not
        read: base-model batches pay no LoRA math). x and y are flattened past their two leading dims."""
        if module not in self.pools.a:
            return y
        if self.layer_index is None:
            raise ValueError("MultiLora.add needs a decoder layer: call layer(i) first")
        i, n = self.layer_index, x.shape[0] * x.shape[1]

        def with_delta() -> jax.Array:
            a, b = self.pools.a[module][i], self.pools.b[module][i]
            delta = lora_apply(x.reshape(n, -1), a, b, self.pools.scaling, slots=self.slots)
            return y + delta.reshape(y.shape).astype(y.dtype)

        return jax.lax.cond(self.active, with_delta, lambda: y)


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
