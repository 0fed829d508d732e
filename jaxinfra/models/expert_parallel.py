"""Expert parallelism: a mixture of experts whose experts are split over mesh axes, which also split
the tokens (training) or over which the replicated tokens are sliced (serving). Under shard_map each
device routes its own tokens, sends every token copy to the device holding its expert (one
all-to-all), runs its local experts as grouped matmuls and sends the results back (a second
all-to-all); expert weights never leave their device. Dropless: each device reserves room for all of
its copies per destination, so nothing is dropped whatever the routing."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from sharding.logical import active_rules, logical_to_spec

Weights = tuple[jax.Array, jax.Array, jax.Array]
RouterSums = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # probabilities [X], squared lse, copies [X], tokens


def expert_axes(num_experts: int) -> tuple[str, ...]:
    """The mesh axes the active rules split the experts over (none outside rules or at size 1)."""
    active = active_rules()
    if active is None:
        return ()
    mesh, rules = active
    spec = logical_to_spec(("experts",), rules, (num_experts,), mesh)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
    return axes if math.prod(mesh.shape[a] for a in axes) > 1 else ()


def _exchange(
    x: Float[Array, "N E"],
    experts: Int[Array, "N K"],
    local_experts: int,
    parts: int,
    axis: tuple[str, ...],
    ffn: Callable[[jax.Array, jax.Array], jax.Array],
) -> Float[Array, "NK E"]:
    """Each token copy's expert output: copies to their experts' devices, `ffn(rows, local expert
    ids)` there, results back, in the copies' flat (token * k + slot) order."""
    n, k = experts.shape
    copies = n * k
    flat = experts.reshape(-1)
    dest = flat // local_experts
    order = jnp.argsort(flat, stable=True)  # by expert, so by destination device
    counts = jnp.bincount(dest, length=parts)
    slot_sorted = jnp.arange(copies) - (jnp.cumsum(counts) - counts)[dest[order]]
    slot = jnp.zeros_like(slot_sorted).at[order].set(slot_sorted)  # each copy's row at its destination
    send = jnp.zeros((parts, copies, x.shape[1]), x.dtype).at[dest, slot].set(jnp.repeat(x, k, axis=0))
    ids = jnp.full((parts, copies), local_experts, jnp.int32).at[dest, slot].set(flat % local_experts)
    recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)
    recv_ids = jax.lax.all_to_all(ids, axis, 0, 0, tiled=True)
    out = ffn(recv.reshape(parts * copies, -1), recv_ids.reshape(-1)).reshape(parts, copies, -1)
    back = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)
    return back[dest, slot]


def expert_parallel_moe(
    h: Float[Array, "B T E"],
    valid: Bool[Array, "B T"],
    router: Float[Array, "E X"],
    expert_weights: tuple[jax.Array, jax.Array, jax.Array],
    route: Callable[[jax.Array], tuple[jax.Array, jax.Array, jax.Array]],
    sums: Callable[[jax.Array, jax.Array, jax.Array, jax.Array], RouterSums],
    local_ffn: Callable[[jax.Array, jax.Array, Weights], jax.Array],
    axes: tuple[str, ...],
) -> tuple[Float[Array, "B T E"], RouterSums]:
    """The routed experts' output for `h` with experts split over `axes`, and the router's statistics
    summed over the whole batch's `valid` tokens. Where the batch is split over `axes` too (training),
    each device routes its own tokens; where it is replicated over them (serving: experts folded into
    the tensor-parallel devices) each device takes an equal slice of the tokens, and the outputs are
    gathered back. `route(logits)` -> (weights, ids, probs); `sums(logits, probs, ids, valid)` ->
    the statistics' sums; `local_ffn(rows, local ids, weights)` runs this device's experts (ids past
    them: zero rows)."""
    active = active_rules()
    assert active is not None
    mesh, rules = active
    x_spec = logical_to_spec(("batch", "length", "embed"), rules, h.shape, mesh)
    token_axes = tuple(a for s in x_spec[:2] if s is not None for a in ((s,) if isinstance(s, str) else s))
    spread = tuple(a for a in axes if a not in token_axes)  # the batch is replicated over these: slice it
    slices = math.prod(mesh.shape[a] for a in spread)
    num_experts = router.shape[1]
    parts = math.prod(mesh.shape[a] for a in axes)
    w_spec = PartitionSpec(axes, None, None)

    def body(h: jax.Array, valid: jax.Array, router: jax.Array, *weights: jax.Array) -> tuple[jax.Array, tuple]:
        b, t, e = h.shape
        x, keep = h.reshape(b * t, e), valid.reshape(b * t)
        if spread:  # this device's slice of the replicated tokens (padding rows do not count)
            n = -(-(b * t) // slices)
            x, keep = jnp.pad(x, ((0, n * slices - b * t), (0, 0))), jnp.pad(keep, (0, n * slices - b * t))
            start = jax.lax.axis_index(spread) * n
            x, keep = jax.lax.dynamic_slice_in_dim(x, start, n), jax.lax.dynamic_slice_in_dim(keep, start, n)
        logits = jnp.einsum("ne,ex->nx", x.astype(jnp.float32), router.astype(jnp.float32))
        w, ids, probs = route(logits)
        local = num_experts // parts
        y = _exchange(x, ids, local, parts, axes, lambda rows, lid: local_ffn(rows, lid, weights))  # type: ignore[arg-type]
        out = jnp.sum(y.astype(jnp.float32).reshape(x.shape[0], -1, e) * w[..., None], axis=1).astype(h.dtype)
        if spread:
            out = jax.lax.all_gather(out, spread, tiled=True)[: b * t]
        # statistics of the whole batch: sums over every device's tokens
        totals = jax.lax.psum(sums(logits, probs, ids, keep), (*token_axes, *spread))
        return out.reshape(b, t, e), totals

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(x_spec, PartitionSpec(*x_spec[:2]), PartitionSpec(), w_spec, w_spec, w_spec),
        out_specs=(x_spec, PartitionSpec()),
        check_vma=False,
    )(h, valid, router, *expert_weights)
