"""Reference generation and sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxinfra
from jaxinfra.sampling import ARGMAX_CHUNK, argmax, filter_logits, sample_logits

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out


@pytest.fixture(scope="module")
def model():
    return jaxinfra.load_model("tiny-qwen3")


PROMPTS = [[256, 72, 101, 108], [256, 9, 8, 7, 6, 5, 4, 3, 2, 1], [256]]


def test_cached_greedy_equals_full_recompute(model):
    """The KV-cached decode loop agrees with re-running the whole sequence every step."""
    got = jaxinfra.generate(model, PROMPTS, jaxinfra.GenerationConfig(max_new_tokens=12, stop_at_eos=False))
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    for prompt, tokens in zip(PROMPTS, got):
        seq = list(prompt)
        for _ in range(12):
            padded = np.zeros((1, 24), np.int32)  # causal: the zero tail cannot affect position len-1
            padded[0, : len(seq)] = seq
            seq.append(int(jnp.argmax(forward(state, jnp.asarray(padded))[0, len(seq) - 1])))
        assert tokens == seq[len(prompt) :]


def test_sampling_is_reproducible_per_seed(model):
    cfg = jaxinfra.GenerationConfig(max_new_tokens=16, temperature=1.0, seed=7, stop_at_eos=False)
    a = jaxinfra.generate(model, PROMPTS, cfg)
    assert a == jaxinfra.generate(model, PROMPTS, cfg)
    b = jaxinfra.generate(
        model, PROMPTS, jaxinfra.GenerationConfig(max_new_tokens=16, temperature=1.0, seed=8, stop_at_eos=False)
    )
    assert a != b


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    greedy = jaxinfra.generate(model, PROMPTS, jaxinfra.GenerationConfig(max_new_tokens=10, stop_at_eos=False))
    for kwargs in ({"top_k": 1}, {"top_p": 1e-6}):
        cfg = jaxinfra.GenerationConfig(max_new_tokens=10, temperature=1.3, seed=3, stop_at_eos=False, **kwargs)
        assert jaxinfra.generate(model, PROMPTS, cfg) == greedy


def test_stops_at_eos(model):
    greedy = jaxinfra.generate(model, PROMPTS[:1], jaxinfra.GenerationConfig(max_new_tokens=10, stop_at_eos=False))[0]
    eos = greedy[3]
    out = jaxinfra.generate(model, PROMPTS[:1], jaxinfra.GenerationConfig(max_new_tokens=10), eos_token_ids=[eos])[0]
    assert out == greedy[: greedy.index(eos) + 1]


def test_filter_logits_keeps_the_right_sets():
    logits = jnp.log(jnp.array([[0.5, 0.05, 0.3, 0.15], [0.1, 0.2, 0.3, 0.4]]))
    kept = np.isfinite(np.asarray(filter_logits(logits, top_k=2)))
    assert kept.tolist() == [[True, False, True, False], [False, False, True, True]]
    kept = np.isfinite(np.asarray(filter_logits(logits, top_p=0.75)))
    assert kept.tolist() == [[True, False, True, False], [False, True, True, True]]


@pytest.mark.parametrize("vocab", [7, ARGMAX_CHUNK, ARGMAX_CHUNK + 1, 4096, 5003])
def test_two_pass_argmax_equals_jnp_argmax(vocab):
    """Same index as jnp.argmax on random logits, with ties (the first wins, across chunks too), -inf
    rows, NaN (counted as the largest) and a vocabulary that is no multiple of the chunk; batch axes kept."""
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((3, 9, vocab)).astype(np.float32)
    x[0, 0] = np.round(x[0, 0])  # many ties, first in the lowest chunk
    x[0, 1, -1] = x[0, 1, 0] = x[0, 1].max() + 1  # a tie between the first and last chunk
    x[0, 2] = -np.inf
    x[0, 3, vocab // 2] = np.nan
    x[0, 4, [1, vocab - 1]] = np.nan
    x[1, 0, -1] = 100.0  # the largest in the padded last chunk
    got = jax.jit(argmax)(jnp.asarray(x))
    assert got.dtype == jnp.int32 and got.shape == (3, 9)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))


def test_sampling_follows_the_distribution():
    probs = np.array([0.6, 0.3, 0.1, 0.0])
    logits = jnp.log(jnp.asarray(np.tile(probs, (20000, 1))))
    draws = np.asarray(sample_logits(logits, jax.random.key(0), temperature=1.0))
    freq = np.bincount(draws, minlength=4) / draws.size
    np.testing.assert_allclose(freq, probs, atol=0.015)


@pytest.mark.parametrize(
    "field,value", [("max_new_tokens", 0), ("temperature", -1.0), ("top_k", -2), ("top_p", 0.0), ("top_p", 1.5)]
)
def test_bad_generation_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        jaxinfra.GenerationConfig(**{field: value})


def test_bad_prompts(model):
    with pytest.raises(ValueError, match="non-empty"):
        jaxinfra.generate(model, [[]])
    with pytest.raises(ValueError, match="outside"):
        jaxinfra.generate(model, [[1, 99999]])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        jaxinfra.generate(model, [[1] * 10], jaxinfra.GenerationConfig(max_new_tokens=5000))


def test_generate_text_decodes(model):
    tok = jaxinfra.load_tokenizer("tiny-qwen3")
    texts = jaxinfra.generate_text(
        model, tok, ["Hello", "A longer prompt"], jaxinfra.GenerationConfig(max_new_tokens=4)
    )
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
