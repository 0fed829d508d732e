"""Verifying k draft tokens per row on device (static k), so the output is distributed exactly as the
target model's samples (Leviathan et al. / Chen et al.; vLLM's RejectionSampler).

Greedy rows accept drafts while they equal the target's argmax; random rows accept draft d at
position j with probability min(1, p_j(d) / q_j(d)) and, at the first rejection, draw from the
residual max(0, p_j - q_j) normalised. Every accepted row also gets the target's bonus token. p is
the distribution `serve.core.sampler` would sample (penalties, min_tokens bans, temperature, top-k/top-p/
min-p), with position j seeing the drafts before it in its history; n-gram drafts are deterministic,
so their q is one-hot. Randomness is keyed by (seed, sibling, output position) as in the sampler.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxinfra.sampling import argmax
from serve.core.sampler import SamplingTensors, apply_penalties, ban_held_tokens, filtered_probs, row_key


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecOutput:
    tokens: Int[Array, "B K1"]  # emitted tokens, -1 after the last
    num_emitted: Int[Array, " B"]  # accepted drafts + 1


def _per_position(t: SamplingTensors, k1: int) -> SamplingTensors:
    """Each row's settings repeated for its k+1 positions, out_pos advancing with the position."""
    rep = jax.tree.map(lambda x: jnp.repeat(x, k1, axis=0), t)
    offsets = jnp.tile(jnp.arange(k1, dtype=rep.out_pos.dtype), t.out_pos.shape[0])
    return dataclasses.replace(rep, out_pos=rep.out_pos + offsets)


def _with_drafts(
    history: Int[Array, "B L"], is_output: Bool[Array, "B L"], drafts: Int[Array, "B K"]
) -> tuple[Int[Array, "N L2"], Bool[Array, "N L2"]]:
    """Position j's penalty history: the row's history plus its drafts before j (as output)."""
    b, k = drafts.shape
    before = jnp.arange(k)[None, :] < jnp.arange(k + 1)[:, None]  # [k+1, k]
    extra = jnp.where(before[None], drafts[:, None, :], -1)  # [B, k+1, k]
    hist = jnp.concatenate([jnp.broadcast_to(history[:, None], (b, k + 1, history.shape[1])), extra], axis=2)
    out = jnp.concatenate(
        [jnp.broadcast_to(is_output[:, None], (b, k + 1, is_output.shape[1])), jnp.ones_like(extra, bool)], axis=2
    )
    return hist.reshape(b * (k + 1), -1), out.reshape(b * (k + 1), -1)


def _keys(t: SamplingTensors) -> jax.Array:
    def one(seed: jax.Array, sibling: jax.Array, pos: jax.Array) -> jax.Array:
        return jax.random.fold_in(row_key(seed, sibling, pos), 0x5BEC)  # apart from the sampler's stream

    return jax.vmap(one)(t.seed, t.sibling, t.out_pos)


def rejection_sample(
    draft_ids: Int[Array, "B K"],
    draft_probs: Float[Array, "B K V"] | None,
    target_logits: Float[Array, "B K1 V"],
    t: SamplingTensors,
    *,
    eos_ids: tuple[int, ...] = (),
    history: Int[Array, "B L"] | None = None,
    history_is_output: Bool[Array, "B L"] | None = None,
) -> SpecOutput:
    """Accept a prefix of each row's drafts (-1 = no draft there) and emit one more token.

    `draft_probs` is the distribution each draft was sampled from after the same processing (None:
    deterministic drafts, as n-gram's). `history` (-1 pads) turns on penalties as in the sampler."""
    b, k = draft_ids.shape
    v = target_logits.shape[-1]
    flat_t = _per_position(t, k + 1)
    logits = target_logits.reshape(b * (k + 1), v).astype(jnp.float32)
    if history is not None:
        assert history_is_output is not None
        logits = apply_penalties(logits, flat_t, *_with_drafts(history, history_is_output, draft_ids))
    masked = ban_held_tokens(logits, flat_t, eos_ids)
    greedy = argmax(masked).reshape(b, k + 1)
    has_draft = draft_ids >= 0
    safe_ids = jnp.where(has_draft, draft_ids, 0)

    def random_path() -> tuple[jax.Array, jax.Array]:
        p = filtered_probs(masked, flat_t).reshape(b, k + 1, v)
        q = jax.nn.one_hot(safe_ids, v, dtype=p.dtype) if draft_probs is None else draft_probs.astype(p.dtype)
        q = jnp.where(has_draft[..., None], q, 0.0)
        q = jnp.concatenate([q, jnp.zeros((b, 1, v), p.dtype)], axis=1)  # the bonus position: no draft
        keys = _keys(flat_t)
        u_keys, r_keys = jax.vmap(jax.random.split, out_axes=1)(keys)
        u = jax.vmap(jax.random.uniform)(u_keys).reshape(b, k + 1)[:, :k]
        p_d = jnp.take_along_axis(p[:, :k], safe_ids[..., None], axis=-1)[..., 0]
        q_d = jnp.take_along_axis(q[:, :k], safe_ids[..., None], axis=-1)[..., 0]
        accept = has_draft & (u * q_d < p_d)
        residual = jnp.maximum(p - q, 0.0)
        residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p).reshape(b * (k + 1), v)
        recovered = jax.vmap(jax.random.categorical)(r_keys, jnp.log(residual)).astype(jnp.int32)
        return accept, recovered.reshape(b, k + 1)

    random_rows = t.temperature > 0
    accept_r, fallback_r = jax.lax.cond(jnp.any(random_rows), random_path, lambda: (jnp.zeros((b, k), bool), greedy))
    accept = jnp.where(random_rows[:, None], accept_r, has_draft & (draft_ids == greedy[:, :k]))
    fallback = jnp.where(random_rows[:, None], fallback_r, greedy)
    num_accepted = jnp.cumprod(accept, axis=1).sum(axis=1).astype(jnp.int32)
    pos = jnp.arange(k + 1)[None, :]
    drafts_padded = jnp.concatenate([draft_ids, jnp.full((b, 1), -1, draft_ids.dtype)], axis=1)
    tokens = jnp.where(
        pos < num_accepted[:, None], drafts_padded, jnp.where(pos == num_accepted[:, None], fallback, -1)
    )
    return SpecOutput(tokens.astype(jnp.int32), num_accepted + 1)
