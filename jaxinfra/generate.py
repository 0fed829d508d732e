"""Reference generation: contiguous KV cache, plain attention, jitted prefill and decode.

Deliberately simple: it is the oracle the serving engine is checked against.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfra.models import LlamaModel
from jaxinfra.sampling import sample_logits
from jaxinfra.tokenizer import Tokenizer
from pallas_kernels import ContiguousCacheMetadata, KVCache


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings; temperature 0 is greedy, top_k 0 and top_p 1 turn those filters off."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "top_k", "top_p"), donate_argnums=(2,))
def _step(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    caches: list[KVCache],
    ids: jax.Array,
    positions: jax.Array,
    last_index: jax.Array,
    key: jax.Array,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
) -> tuple[jax.Array, list[KVCache]]:
    """Write `ids` into the caches at `positions`, then sample the token after `last_index`."""
    model = nnx.merge(graphdef, state)
    h, caches, _ = model.hidden_states(ids, positions, ContiguousCacheMetadata(positions), caches)
    last = model.logits(h[jnp.arange(ids.shape[0]), last_index])
    return sample_logits(last, key, temperature=temperature, top_k=top_k, top_p=top_p), caches


def generate(
    model: LlamaModel,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig = GenerationConfig(),
    eos_token_ids: Sequence[int] = (),
) -> list[list[int]]:
    """New token ids per prompt (ending with the EOS token when one is produced)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token id lists")
    cfg = model.cfg
    lens = np.array([len(p) for p in prompts], np.int32)
    batch, width = len(prompts), int(lens.max())
    max_len = width + config.max_new_tokens
    if max_len > cfg.context_length:
        raise ValueError(
            f"prompt ({width}) + max_new_tokens ({config.max_new_tokens}) exceeds "
            f"the model's context length ({cfg.context_length}: max_position_embeddings with its RoPE scaling)"
        )
    ids = np.zeros((batch, width), np.int32)
    for i, p in enumerate(prompts):
        if min(p) < 0 or max(p) >= cfg.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {cfg.vocab_size})")
        ids[i, : len(p)] = p
    graphdef, state = nnx.split(model)
    sampling = dict(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p)
    key = jax.random.key(config.seed)
    caches = model.init_caches(batch, max_len)
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (batch, width))
    tokens, caches = _step(
        graphdef,
        state,
        caches,
        jnp.asarray(ids),
        jnp.asarray(positions),
        jnp.asarray(lens - 1),
        jax.random.fold_in(key, 0),
        **sampling,
    )
    eos = set(eos_token_ids) if config.stop_at_eos else set()
    outputs: list[list[int]] = [[] for _ in prompts]
    done = np.zeros(batch, bool)
    for step in range(config.max_new_tokens):
        for i, t in enumerate(np.asarray(tokens).tolist()):
            if not done[i]:
                outputs[i].append(t)
                done[i] = t in eos
        if done.all() or step == config.max_new_tokens - 1:
            break
        positions = (lens + step)[:, None]
        tokens, caches = _step(
            graphdef,
            state,
            caches,
            tokens[:, None],
            jnp.asarray(positions),
            jnp.zeros(batch, jnp.int32),
            jax.random.fold_in(key, step + 1),
            **sampling,
        )
    return outputs


def generate_text(
    model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    config: GenerationConfig = GenerationConfig(),
) -> list[str]:
    """Encode, generate, decode (special tokens dropped)."""
    eos = tuple(dict.fromkeys([*model.cfg.eos_token_id, *tokenizer.eos_token_ids]))
    outputs = generate(model, [tokenizer.encode(p) for p in prompts], config, eos)
    return [tokenizer.decode(o) for o in outputs]
