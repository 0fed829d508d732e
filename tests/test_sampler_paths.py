"""Which path the sampler takes for a batch of random rows, and that every path draws the same token:
OpenAI's defaults (temperature 1, no top-k/top-p, what guidellm sends) and supports that fit within the
top candidates must not sort the vocabulary (issue 27: a full sort per row per step stalled guidellm)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import serve.core.sampler as sampler
from jaxinfra.sampling import filter_logits
from serve import SamplingParams
from serve.core.sampler import TOPK_CANDIDATES, SamplingTensors, row_key, row_settings, sample, uniform_tensors

VOCAB = 4096


def sorts_and_tokens(monkeypatch: pytest.MonkeyPatch, logits: jax.Array, **rows: object) -> tuple[int, np.ndarray]:
    """(how many times the full-vocabulary sort ran, the sampled tokens) for one batch of rows."""
    ran: list[int] = []

    def counted(*args: object, **kwargs: object) -> jax.Array:
        jax.debug.callback(lambda: ran.append(1))  # fires only where the branch actually runs
        return filter_logits(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sampler, "filter_logits", counted)
    t = uniform_tensors(logits.shape[0], **rows)
    tokens = jax.jit(lambda lg, tt: sample(lg, tt).tokens)(logits, t)
    jax.effects_barrier()
    return len(ran), np.asarray(tokens)


def reference(logits: jax.Array, **rows: object) -> np.ndarray:
    """Gumbel-max over filter_logits' support with the sampler's per-row noise (or greedy)."""
    return np.asarray(_reference(logits, uniform_tensors(logits.shape[0], **rows)))


@jax.jit
def _reference(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    scaled = logits / jnp.where(t.temperature > 0, t.temperature, 1.0)[:, None]
    keys = jax.vmap(row_key)(t.seed, t.sibling, t.out_pos)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[1],)))(keys)
    drawn = jnp.argmax(filter_logits(scaled, top_k=t.top_k, top_p=t.top_p, min_p=t.min_p) + noise, axis=-1)
    return jnp.where(t.temperature > 0, drawn, jnp.argmax(logits, axis=-1))


def peaked_logits(rows: int, seed: int) -> jax.Array:
    """A trained model's shape of distribution: a few dozen likely tokens over a long flat tail."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    flat = jax.random.normal(k1, (rows, VOCAB))
    head = jax.random.randint(k2, (rows, 12), 0, VOCAB)
    return flat.at[jnp.arange(rows)[:, None], head].add(9.0)


def test_openai_defaults_and_small_supports_sample_without_sorting(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = row_settings(SamplingParams(max_tokens=64, ignore_eos=True), seed=7, sibling=0, vocab_size=VOCAB)
    assert defaults["temperature"] == 1.0 and defaults["top_k"] == 0 and defaults["top_p"] == 1.0
    per_row = {  # greedy, OpenAI defaults, top-k, top-p, min-p, top-k then top-p, temperature 0.7
        "temperature": [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7],
        "top_k": [0, 0, 20, 0, 0, 30, 0],
        "top_p": [1.0, 1.0, 1.0, 0.9, 1.0, 0.8, 1.0],
        "min_p": [0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0],
    }
    positions = 6  # each setting at several output positions: one batch of 42 rows
    rows = {name: np.tile(np.array(v), positions) for name, v in per_row.items()}
    rows["out_pos"] = np.repeat(np.arange(positions), 7)
    rows["seed"] = np.arange(7 * positions) + defaults["seed"]
    logits = peaked_logits(7 * positions, 0)
    sorts, tokens = sorts_and_tokens(monkeypatch, logits, **rows)
    assert sorts == 0, "the sampler sorted the vocabulary"
    np.testing.assert_array_equal(tokens, reference(logits, **rows))


def test_a_support_past_the_candidates_sorts_and_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = jax.random.normal(jax.random.key(1), (2, VOCAB))  # flat: top-p 0.999 spans most of it
    rows = {"temperature": 1.0, "seed": np.array([3, 4]), "top_k": [TOPK_CANDIDATES + 1, 0], "top_p": [1.0, 0.999]}
    sorts, tokens = sorts_and_tokens(monkeypatch, logits, **rows)
    assert sorts == 1
    np.testing.assert_array_equal(tokens, reference(logits, **rows))
