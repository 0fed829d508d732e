"""On-device sampling for a batch of requests, each with its own settings and RNG stream."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row settings [S]. Keys come from (seed, sibling index, output position), so a request's
    samples do not depend on what else is in the batch. `history` [S, L] holds prompt + output ids
    (-1 padding) for penalties; `banned` [S, K] ids that may not be sampled yet (min_tokens)."""

    temperature: Float[Array, "S"]
    top_k: Int[Array, "S"]
    top_p: Float[Array, "S"]
    min_p: Float[Array, "S"]
    seed: Int[Array, "S"]
    sibling: Int[Array, "S"]
    out_pos: Int[Array, "S"]
    presence: Float[Array, "S"]
    frequency: Float[Array, "S"]
    repetition: Float[Array, "S"]
    history: Int[Array, "S L"]
    history_is_output: Int[Array, "S L"]
    banned: Int[Array, "S K"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    tokens: Int[Array, "S"]
    logprob: Float[Array, "S"]       # log p(sampled token) under the model's raw distribution
    top_ids: Int[Array, "S N"]
    top_logprobs: Float[Array, "S N"]


def _apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    s, v = logits.shape
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], t.history.shape)
    ids = jnp.where(t.history < 0, v, t.history)  # padding -> dropped
    seen = jnp.zeros((s, v), bool).at[rows, ids].set(True, mode="drop")
    out_counts = jnp.zeros((s, v), jnp.float32).at[rows, ids].add(t.history_is_output.astype(jnp.float32),
                                                                    mode="drop")
    rep = t.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency[:, None] * out_counts - t.presence[:, None] * (out_counts > 0)
    return logits


def _filter(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Per-row top-k, top-p and min-p on temperature-scaled logits."""
    v = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    kth = jnp.take_along_axis(sorted_desc, jnp.clip(t.top_k - 1, 0, v - 1)[:, None], axis=-1)
    logits = jnp.where((t.top_k[:, None] > 0) & (logits < kth), -jnp.inf, logits)
    sorted_desc = jnp.where((t.top_k[:, None] > 0) & (sorted_desc < kth), -jnp.inf, sorted_desc)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    cut = jnp.min(jnp.where(mass_before < t.top_p[:, None], sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cut, -jnp.inf, logits)
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.where(p < t.min_p[:, None] * jnp.max(p, axis=-1, keepdims=True), -jnp.inf, logits)


def _row_key(seed: jax.Array, sibling: jax.Array, pos: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), sibling), pos)


def sample(logits: Float[Array, "S V"], t: SamplingTensors, *, num_logprobs: int, use_penalties: bool) -> SamplerOutput:
    """Sample one token per row; temperature 0 rows are greedy, and an all-greedy batch skips the
    random path at run time. Logprobs are of the raw logits."""
    logits = logits.astype(jnp.float32)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    if use_penalties:
        logits = _apply_penalties(logits, t)
    s, v = logits.shape
    banned_ids = jnp.where(t.banned < 0, v, t.banned)
    logits = logits.at[jnp.arange(s)[:, None], banned_ids].set(-jnp.inf, mode="drop")
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def random_rows() -> jax.Array:
        scaled = _filter(logits / jnp.where(t.temperature > 0, t.temperature, 1.0)[:, None], t)
        keys = jax.vmap(_row_key)(t.seed, t.sibling, t.out_pos)
        sampled = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, scaled)
        return jnp.where(t.temperature > 0, sampled, greedy).astype(jnp.int32)

    tokens = jax.lax.cond(jnp.any(t.temperature > 0), random_rows, lambda: greedy)
    top_lps, top_ids = jax.lax.top_k(raw_logprobs, max(num_logprobs, 1))
    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    return SamplerOutput(tokens, chosen, top_ids.astype(jnp.int32), top_lps)
