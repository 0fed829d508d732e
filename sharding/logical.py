"""Logical axis names -> mesh axes. Model code names axes; only this package maps them to a mesh."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LOGICAL_AXES = (
    "batch",
    "length",
    "embed",
    "mlp",
    "heads",
    "kv_heads",
    "head_dim",
    "vocab",
    "layers",
    "stage",
    "experts",
)
MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("rules", default=None)


def logical_to_spec(
    names: Sequence[str | None], rules: Rules, shape: Sequence[int] | None = None, mesh: Mesh | None = None
) -> PartitionSpec:
    """PartitionSpec for logical `names` under `rules` (unmapped names are replicated). Given the
    array's shape and the mesh, mesh axes that would not divide a dimension are left out."""
    unknown = [n for n in names if n is not None and n not in LOGICAL_AXES]
    if unknown:
        raise ValueError(f"unknown logical axis name(s) {unknown}; known: {LOGICAL_AXES}")
    spec: list[str | tuple[str, ...] | None] = []
    used: set[str] = set()
    for i, name in enumerate(names):
        axes = rules.get(name) if name is not None else None
        flat = (axes,) if isinstance(axes, str) else tuple(axes or ())
        flat = tuple(a for a in flat if a not in used)  # a mesh axis may shard one dim only
        if shape is not None and mesh is not None:
            kept, size = [], 1
            for a in flat:
                if shape[i] % (size * mesh.shape[a]) == 0:
                    kept.append(a)
                    size *= mesh.shape[a]
            flat = tuple(kept)
        used.update(flat)
        spec.append(None if not flat else flat[0] if len(flat) == 1 else flat)
    return PartitionSpec(*spec)


@contextlib.contextmanager
def logical_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Within this block, `constrain` shards activations on `mesh` by `rules`."""
    token = _ACTIVE.set((mesh, dict(rules)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rules() -> tuple[Mesh, Rules] | None:
    """The mesh and rules `logical_rules` activated (None outside it)."""
    return _ACTIVE.get()


def constrain(x: jax.Array, names: Sequence[str | None], *, unmapped_free: bool = False) -> jax.Array:
    """Sharding constraint on an activation by logical names; identity when no rules are active.
    `unmapped_free`: dimensions the rules do not map stay unconstrained (the compiler picks) instead
    of replicated: for weights, whose FSDP gather should happen where they are used, after any cast."""
    if len(names) != x.ndim:
        raise ValueError(f"{len(names)} logical names {tuple(names)} for an array of rank {x.ndim}")
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_spec(names, rules, x.shape, mesh)
    if unmapped_free:
        spec = PartitionSpec(*(PartitionSpec.UNCONSTRAINED if s is None else s for s in spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


Names = Sequence[str | None]
NamesOf = Names | Callable[[jax.Array], Names]  # names of one array, or of each leaf of a pytree


def per_device(
    fn: Callable[..., Any],
    args: Sequence[Any],
    names: Sequence[NamesOf],
    out: int | tuple[int, ...] = 0,
    result: tuple[Names, Sequence[int]] | None = None,
) -> Any:
    """`fn(*args)` run on each device's shards (jax.shard_map), each arg split by its logical names
    (a pytree arg: by a function of each leaf) under the active rules; the result laid out like
    `args[out]` (a tuple of results: like each of those args), or by `result` = (its names, its
    global shape). Plain `fn(*args)` when no rules are active. For kernels the compiler cannot
    partition: a pallas_call would otherwise be computed whole on every device, its sharded inputs
    gathered first."""
    active = _ACTIVE.get()
    if active is None:
        return fn(*args)
    mesh, rules = active

    def specs(tree: Any, n: NamesOf) -> Any:
        if callable(n):
            return jax.tree.map(lambda x: logical_to_spec(n(x), rules, x.shape, mesh), tree)
        return logical_to_spec(n, rules, tree.shape, mesh)

    in_specs = tuple(specs(a, n) for a, n in zip(args, names, strict=True))
    out_specs: Any
    if result is not None:
        out_specs = logical_to_spec(result[0], rules, result[1], mesh)
    else:
        out_specs = in_specs[out] if isinstance(out, int) else tuple(in_specs[i] for i in out)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def sharded_axes(name: str | None, size: int) -> tuple[tuple[str, ...], int]:
    """The mesh axes the active rules split a dimension of logical `name` and `size` over, and into
    how many parts (none, 1 outside `logical_rules`)."""
    active = _ACTIVE.get()
    if active is None or name is None:
        return (), 1
    mesh, rules = active
    spec = logical_to_spec((name,), rules, (size,), mesh)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
    return axes, math.prod(mesh.shape[a] for a in axes)


def named_sharding(names: Sequence[str | None], rules: Rules, shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, rules, shape, mesh))


def shard_state(state: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    """Place each variable on `mesh` by its `logical_axes` metadata (replicated where it has none)."""

    def place(var: nnx.Variable) -> nnx.Variable:
        names = var.get_metadata().get("logical_axes", (None,) * var.ndim)
        return var.replace(value=jax.device_put(var[...], named_sharding(names, rules, var.shape, mesh)))

    return jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def dim_shards(sharding: NamedSharding, dim: int = 0) -> int:
    """How many ways `sharding` splits dimension `dim` of an array."""
    spec = tuple(sharding.spec) + (None,) * (dim + 1)
    axes = spec[dim]
    names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(sharding.mesh.shape[a] for a in names)
