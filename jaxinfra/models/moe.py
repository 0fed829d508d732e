"""Mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE): a float32 softmax top-k router,
dropless dispatch (token copies sorted by expert, one grouped matmul per projection over the ragged
groups), an optional capacity that drops overflow for training, and the router's statistics (load-
balancing loss, z-loss, tokens per expert) returned when ForwardOptions.router_stats asks for them."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jaxinfra.config import ModelConfig
from jaxinfra.models.expert_parallel import RouterSums, expert_axes, expert_parallel_moe
from jaxinfra.models.options import ForwardOptions
from jaxinfra.models.params import normal_param
from pallas_kernels.grouped_matmul import grouped_matmul
from sharding import constrain


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RouterStats:
    """One MoE layer's router on one batch (or layers stacked on a leading axis)."""

    aux_loss: jax.Array  # HF load-balancing loss: experts * sum_e (copies_e / tokens) * mean prob_e (k if uniform)
    z_loss: jax.Array  # mean over tokens of logsumexp(router logits)^2
    counts: jax.Array  # [..., num_experts] int32: token copies routed to each expert (before any capacity)


def route(
    logits: Float[Array, "N X"], k: int, normalize: bool
) -> tuple[Float[Array, "N K"], Int[Array, "N K"], Float[Array, "N X"]]:
    """Softmax top-k in float32: (weights, expert ids, all probabilities); weights renormalized to
    sum to 1 when `normalize` (Mixtral, Qwen3-MoE), raw probabilities otherwise (Qwen2-MoE)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts, probs


def router_sums(
    logits: Float[Array, "N X"], probs: Float[Array, "N X"], experts: Int[Array, "N K"], valid: Bool[Array, " N"] | None
) -> RouterSums:
    """Over a batch's valid tokens (all when None): router probabilities summed per expert, squared
    logsumexp of the logits summed, token copies per expert, and the token count; sums, so devices
    holding parts of the batch add theirs."""
    w = jnp.ones(logits.shape[:1], jnp.float32) if valid is None else valid.astype(jnp.float32)
    counts = jnp.bincount(experts.reshape(-1), jnp.repeat(w, experts.shape[1]), length=logits.shape[1])
    z = jnp.sum(w * jax.nn.logsumexp(logits, axis=-1) ** 2)
    return jnp.sum(probs * w[:, None], axis=0), z, counts.astype(jnp.int32), jnp.sum(w)


def router_stats(sums: RouterSums) -> RouterStats:
    """RouterStats from a batch's `router_sums`; the load-balancing loss as transformers'
    load_balancing_loss_func (mean probability and copies per token of each expert)."""
    prob_sum, z_sum, counts, tokens = sums
    tokens = jnp.maximum(tokens, 1.0)
    aux = prob_sum.shape[0] * jnp.sum(counts.astype(jnp.float32) / tokens * (prob_sum / tokens))
    return RouterStats(aux, z_sum / tokens, counts)


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """Token copies in expert order: `order[i]` is the flat (token * k + slot) index of sorted copy i;
    `group_sizes[e]` the copies expert e computes (overflow past a capacity sorts last, uncomputed)."""

    order: jax.Array
    group_sizes: jax.Array
    counts: jax.Array  # copies routed to each expert before the capacity cut
    kept: jax.Array | None  # [N * k] bool per flat copy, None when dropless


def dispatch(experts: Int[Array, "N K"], num_experts: int, capacity: int | None) -> Dispatch:
    """Sort token copies by expert (stable: token order within a group); with `capacity`, copies past
    it in their expert's group move to the end, outside every group."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    if capacity is None:
        return Dispatch(order, counts, counts, None)
    sorted_experts = flat[order]
    starts = jnp.cumsum(counts) - counts
    keep_sorted = jnp.arange(flat.shape[0]) - starts[sorted_experts] < capacity
    kept = jnp.zeros(flat.shape, bool).at[order].set(keep_sorted)
    order = order[jnp.argsort(jnp.where(keep_sorted, sorted_experts, num_experts), stable=True)]
    return Dispatch(order, jnp.minimum(counts, capacity), counts, kept)


def expert_capacity(tokens: int, k: int, num_experts: int, factor: float | None) -> int | None:
    """Copies each expert may take: ceil(factor * tokens * k / num_experts); None for dropless."""
    return None if factor is None else max(1, math.ceil(factor * tokens * k / num_experts))


def experts_ffn(
    x: Float[Array, "M E"],
    group_sizes: Int[Array, " X"],
    gate: Float[Array, "X E F"],
    up: Float[Array, "X E F"],
    down: Float[Array, "X F E"],
) -> Float[Array, "M E"]:
    """SwiGLU of each row with its group's expert: down(silu(x @ gate) * (x @ up)), as grouped matmuls."""
    gate, up, down = (w.astype(x.dtype) for w in (gate, up, down))
    h = jax.nn.silu(grouped_matmul(x, gate, group_sizes)) * grouped_matmul(x, up, group_sizes)
    return grouped_matmul(h, down, group_sizes)


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts, plus an optional always-on shared expert behind a sigmoid gate
    (Qwen2-MoE). Expert weights are stacked [experts, ...] for the grouped matmuls."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, shared: nnx.Module | None = None) -> None:
        x, e, f, std, dt = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.initializer_range, cfg.dtype
        self.num_experts, self.top_k, self.normalize = x, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = normal_param(rngs, (e, x), ("embed", None), std, dt)
        self.expert_gate = normal_param(rngs, (x, e, f), ("experts", "embed", "mlp"), std, dt)
        self.expert_up = normal_param(rngs, (x, e, f), ("experts", "embed", "mlp"), std, dt)
        self.expert_down = normal_param(rngs, (x, f, e), ("experts", "mlp", "embed"), std, dt)
        self.shared = shared
        if shared is not None:
            self.shared_gate = normal_param(rngs, (e,), ("embed",), std, dt)

    def __call__(
        self,
        h: Float[Array, "B T E"],
        options: ForwardOptions = ForwardOptions(),
        valid: Bool[Array, "B T"] | None = None,
    ) -> tuple[Float[Array, "B T E"], RouterStats | None]:
        """The layer's output and, when options.router_stats, its router's statistics over the `valid`
        tokens (all when None: serving's padded batches pass theirs)."""
        weights = (self.expert_gate[...], self.expert_up[...], self.expert_down[...])
        axes = expert_axes(self.num_experts)
        if axes:  # experts split over devices: tokens travel to them (dropless)
            route_fn = lambda logits: route(logits, self.top_k, self.normalize)
            mask = jnp.ones(h.shape[:2], bool) if valid is None else valid.reshape(h.shape[:2])
            out, sums = expert_parallel_moe(h, mask, self.router[...], weights, route_fn, router_sums, _local, axes)
            stats = router_stats(sums) if options.router_stats else None
        else:
            out, stats = self._routed(h, weights, options, valid)
        if self.shared is not None:
            gate = jax.nn.sigmoid(jnp.einsum("bte,e->bt", h, self.shared_gate[...].astype(h.dtype)))
            out = out + gate[..., None] * self.shared(h, options)
        return constrain(out, ("batch", "length", "embed")), stats

    def _routed(
        self,
        h: Float[Array, "B T E"],
        weights: tuple[jax.Array, jax.Array, jax.Array],
        options: ForwardOptions,
        valid: Bool[Array, "B T"] | None,
    ) -> tuple[jax.Array, RouterStats | None]:
        """The top-k experts' weighted outputs, every expert on this device, and the router's stats."""
        b, t, e = h.shape
        x = h.reshape(b * t, e)
        logits = jnp.einsum("ne,ex->nx", x.astype(jnp.float32), self.router[...].astype(jnp.float32))
        gates, experts, probs = route(logits, self.top_k, self.normalize)
        capacity = expert_capacity(b * t, self.top_k, self.num_experts, options.capacity_factor)
        d = dispatch(experts, self.num_experts, capacity)
        stats = None
        if options.router_stats:
            stats = router_stats(router_sums(logits, probs, experts, None if valid is None else valid.reshape(-1)))
        y = experts_ffn(jnp.take(x, d.order // self.top_k, axis=0), d.group_sizes, *weights)
        w = gates.reshape(-1) if d.kept is None else jnp.where(d.kept, gates.reshape(-1), 0.0)
        copies = jnp.take(y, _inverse(d.order), axis=0).astype(jnp.float32) * w[:, None]
        return jnp.sum(copies.reshape(b * t, self.top_k, e), axis=1).astype(h.dtype).reshape(b, t, e), stats


def _inverse(order: jax.Array) -> jax.Array:
    """The inverse of a permutation."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _local(rows: jax.Array, ids: jax.Array, weights: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
    """Rows through this device's experts by local id (ids past the last expert: zero rows)."""
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=weights[0].shape[0]).astype(jnp.int32)
    return jnp.take(experts_ffn(jnp.take(rows, order, axis=0), sizes, *weights), _inverse(order), axis=0)


def summarize(stats: list[RouterStats]) -> RouterStats | None:
    """Layers' stats (per layer, or layers stacked by a scan) -> one RouterStats over the model:
    aux and z losses averaged over MoE layers, counts [moe layers, experts]; None without MoE layers."""
    if not stats:
        return None
    aux = jnp.concatenate([jnp.atleast_1d(s.aux_loss) for s in stats])
    z = jnp.concatenate([jnp.atleast_1d(s.z_loss) for s in stats])
    counts = jnp.concatenate([s.counts.reshape(-1, s.counts.shape[-1]) for s in stats])
    return RouterStats(jnp.mean(aux), jnp.mean(z), counts)


def imbalance(counts: Int[Array, "*L X"] | Int[np.ndarray, "*L X"]) -> jax.Array | np.floating:
    """Expert load imbalance: max / mean tokens per expert, averaged over layers (1 = perfectly even).
    Array methods only, so numpy counts (the serving engine's, on the host) work too."""
    c = counts.reshape(-1, counts.shape[-1]).astype("float32")
    return (c.max(-1) / c.mean(-1).clip(1e-9)).mean()
