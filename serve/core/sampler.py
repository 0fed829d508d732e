"""On-device sampling for a batch of requests, each with its own settings and RNG stream.

Every request option is data, not shape: one compiled sampler serves greedy and random rows,
top-k/top-p/min-p, min_tokens with stop ids, and logprobs (computed only when a row asks, under
`lax.cond`). Penalties (which need the token history), logit_bias and structured-output token masks
(which the host computes while the forward pass runs) go through a second jitted call on the logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxinfra.sampling import argmax, filter_logits, top_p_min_p_cutoff
from serve.sampling_params import MAX_LOGPROBS, SamplingParams

# When every filtered random row's support lies within this many top logits, sampling works on
# them instead of sorting the whole vocabulary.
TOPK_CANDIDATES = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row settings [S]. Keys come from (seed, sibling index, output position), so a request's
    samples do not depend on what else is in the batch. While out_pos < min_tokens, `stop_ids`
    [S, K] (-1 padding) and, unless ignore_eos, the model's EOS ids may not be sampled."""

    temperature: Float[Array, " S"]
    top_k: Int[Array, " S"]
    top_p: Float[Array, " S"]
    min_p: Float[Array, " S"]
    seed: Int[Array, " S"]
    sibling: Int[Array, " S"]
    out_pos: Int[Array, " S"]
    min_tokens: Int[Array, " S"]
    ignore_eos: Bool[Array, " S"]
    stop_ids: Int[Array, "S K"]
    logprobs: Bool[Array, " S"]
    presence: Float[Array, " S"]
    frequency: Float[Array, " S"]
    repetition: Float[Array, " S"]


# The per-row settings a request carries: (dtype, value for padding rows). out_pos and stop_ids vary
# per step or are two-dimensional, and are filled separately.
ROW_FIELDS: dict[str, tuple[type, float | int | bool]] = {
    "temperature": (np.float32, 0.0),
    "top_k": (np.int32, 0),
    "top_p": (np.float32, 1.0),
    "min_p": (np.float32, 0.0),
    "seed": (np.int32, 0),
    "sibling": (np.int32, 0),
    "min_tokens": (np.int32, 0),
    "ignore_eos": (np.bool_, False),
    "logprobs": (np.bool_, False),
    "presence": (np.float32, 0.0),
    "frequency": (np.float32, 0.0),
    "repetition": (np.float32, 1.0),
}


def uniform_tensors(n: int, **values: Any) -> SamplingTensors:
    """`n` rows of sampler settings: ROW_FIELDS' padding values unless given (a scalar or [n] values
    per field, `out_pos` too, `stop_ids` [n, K]); for tests and benchmarks that drive the sampler."""
    fields: dict[str, Any] = {
        name: np.broadcast_to(np.asarray(values.get(name, pad), dtype), (n,)).copy()
        for name, (dtype, pad) in ROW_FIELDS.items()
    }
    fields["out_pos"] = np.broadcast_to(np.asarray(values.get("out_pos", 0), np.int32), (n,)).copy()
    fields["stop_ids"] = np.asarray(values.get("stop_ids", np.full((n, 1), -1)), np.int32)
    return SamplingTensors(**fields)  # numpy rows; jax arrays once jitted


def row_settings(params: SamplingParams, seed: int, sibling: int, vocab_size: int) -> dict[str, float | int | bool]:
    """One request's values for ROW_FIELDS."""
    return {
        "temperature": params.temperature,
        "top_k": min(params.top_k, vocab_size),
        "top_p": params.top_p,
        "min_p": params.min_p,
        "seed": seed,
        "sibling": sibling,
        "min_tokens": params.min_tokens,
        "ignore_eos": params.ignore_eos,
        "logprobs": params.logprobs is not None,
        "presence": params.presence_penalty,
        "frequency": params.frequency_penalty,
        "repetition": params.repetition_penalty,
    }


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    tokens: Int[Array, " S"]
    logprob: Float[Array, " S"]  # log p(sampled token) under the model's raw distribution
    top_ids: Int[Array, "S N"]  # the MAX_LOGPROBS most likely tokens (rows that asked)
    top_logprobs: Float[Array, "S N"]


def apply_penalties(
    logits: Float[Array, "S V"], t: SamplingTensors, history: Int[Array, "S L"], history_is_output: Bool[Array, "S L"]
) -> Float[Array, "S V"]:
    """vLLM's repetition (prompt + output), frequency and presence (output) penalties; -1 pads history."""
    s, v = logits.shape
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], history.shape)
    ids = jnp.where(history < 0, v, history)  # padding -> dropped
    seen = jnp.zeros((s, v), bool).at[rows, ids].set(True, mode="drop")
    out_counts = jnp.zeros((s, v), jnp.float32).at[rows, ids].add(history_is_output.astype(jnp.float32), mode="drop")
    rep = t.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - t.frequency[:, None] * out_counts - t.presence[:, None] * (out_counts > 0)


def ban_held_tokens(logits: Float[Array, "S V"], t: SamplingTensors, eos_ids: tuple[int, ...]) -> Float[Array, "S V"]:
    """-inf on the stop ids (and EOS unless ignore_eos) of rows still under their min_tokens."""
    s, v = logits.shape
    held = (t.out_pos < t.min_tokens)[:, None]
    eos = jnp.broadcast_to(jnp.asarray(eos_ids or (-1,), jnp.int32), (s, max(len(eos_ids), 1)))
    eos = jnp.where(t.ignore_eos[:, None], -1, eos)
    banned = jnp.where(held, jnp.concatenate([t.stop_ids, eos], axis=1), -1)
    banned = jnp.where(banned < 0, v, banned)
    return logits.at[jnp.arange(s)[:, None], banned].set(-jnp.inf, mode="drop")


def apply_bitmask(logits: Float[Array, "S V"], bitmask: Int[Array, "S W"]) -> Float[Array, "S V"]:
    """-inf where a row's bit for the token is 0 (bit i % 32 of word i // 32; structured outputs)."""
    v = logits.shape[-1]
    ids = jnp.arange(v)
    bits = (bitmask[:, ids // 32] >> (ids % 32)) & 1
    return jnp.where(bits == 1, logits, -jnp.inf)


def row_key(seed: jax.Array, sibling: jax.Array, pos: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), sibling), pos)


def _scaled(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    return logits / jnp.where(t.temperature > 0, t.temperature, 1.0)[:, None]


def filtered_probs(masked: Float[Array, "S V"], t: SamplingTensors) -> Float[Array, "S V"]:
    """The distribution a random row's token is drawn from (temperature, then top-k/top-p/min-p) given
    its `ban_held_tokens` logits; speculative decoding's rejection sampler accepts drafts against it."""
    scaled = _scaled(masked, t)
    return jax.nn.softmax(filter_logits(scaled, top_k=t.top_k, top_p=t.top_p, min_p=t.min_p), axis=-1)


def _random_tokens(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Gumbel-max over the top-k / top-p / min-p support of temperature-scaled logits. The noise is
    drawn per (row key, token id), so the shortcuts pick exactly what the full sort would: a row with
    no filter takes the argmax over the whole vocabulary (OpenAI's defaults, which guidellm and most
    clients send), a row whose support lies within the top TOPK_CANDIDATES logits (top-k, or a
    top-p / min-p set that ends before them) works on those; only a batch with some other row sorts."""
    v = logits.shape[-1]
    scaled = _scaled(logits, t)
    keys = jax.vmap(row_key)(t.seed, t.sibling, t.out_pos)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (v,)))(keys)

    def full_sort() -> jax.Array:
        return argmax(filter_logits(scaled, top_k=t.top_k, top_p=t.top_p, min_p=t.min_p) + noise)

    if v <= TOPK_CANDIDATES:
        return full_sort().astype(jnp.int32)
    no_topk = (t.top_k <= 0) | (t.top_k >= v)
    unfiltered = no_topk & (t.top_p >= 1.0) & (t.min_p <= 0.0)
    topk_on = (t.top_k > 0) & (t.top_k <= TOPK_CANDIDATES)
    vals, ids = jax.lax.top_k(scaled, TOPK_CANDIDATES)
    vals = jnp.where(~topk_on[:, None] | (jnp.arange(TOPK_CANDIDATES)[None, :] < t.top_k[:, None]), vals, -jnp.inf)
    # top-p mass is of the top-k set where there is one (as filter_logits), else of the whole vocabulary
    log_mass = jnp.where(topk_on, jax.nn.logsumexp(vals, axis=-1), jax.nn.logsumexp(scaled, axis=-1))[:, None]
    cutoff = top_p_min_p_cutoff(vals, t.top_p, t.min_p, log_mass=log_mass)
    within = topk_on | (no_topk & (vals[:, -1] < cutoff[:, 0]))  # the last candidate is already cut
    pick = jnp.argmax(jnp.where(vals >= cutoff, vals, -jnp.inf) + jnp.take_along_axis(noise, ids, axis=1), axis=-1)
    shortcut = jnp.where(unfiltered, argmax(scaled + noise), jnp.take_along_axis(ids, pick[:, None], 1)[:, 0])
    cheap = jnp.all((t.temperature <= 0) | unfiltered | within)
    return jax.lax.cond(cheap, lambda: shortcut, full_sort).astype(jnp.int32)


def sample(
    logits: Float[Array, "S V"],
    t: SamplingTensors,
    *,
    eos_ids: tuple[int, ...] = (),
    raw_logits: Float[Array, "S V"] | None = None,
) -> SamplerOutput:
    """One token per row; temperature-0 rows are greedy, and an all-greedy batch skips the random
    path at run time. Logprobs are of `raw_logits` (the model's, before penalties; default `logits`)."""
    raw = (logits if raw_logits is None else raw_logits).astype(jnp.float32)
    masked = ban_held_tokens(logits.astype(jnp.float32), t, eos_ids)
    greedy = argmax(masked)
    tokens = jax.lax.cond(
        jnp.any(t.temperature > 0),
        lambda: jnp.where(t.temperature > 0, _random_tokens(masked, t), greedy),
        lambda: greedy,
    )

    def with_logprobs() -> tuple[jax.Array, jax.Array, jax.Array]:
        lp = jax.nn.log_softmax(raw, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        return jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def without() -> tuple[jax.Array, jax.Array, jax.Array]:
        s = raw.shape[0]
        return (
            jnp.zeros((s,), jnp.float32),
            jnp.zeros((s, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((s, MAX_LOGPROBS), jnp.float32),
        )

    chosen, top_ids, top_lp = jax.lax.cond(jnp.any(t.logprobs), with_logprobs, without)
    return SamplerOutput(tokens, chosen, top_ids, top_lp)
