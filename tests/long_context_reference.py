"""The long-context oracle: one prompt's greedy continuation by the model's own weights over contiguous
K/V, with no pages, no chunks and no batch. Attention is exact softmax attention computed a tile of
queries against a tile of keys at a time (FlashAttention's online softmax in plain jnp), so a
128K-token prompt never holds a 128K x 128K score matrix; the serving engine's paged kernel is not used."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfra.models import LlamaModel
from jaxinfra.models.layers import DecoderLayer
from jaxinfra.models.rope import apply_rope, attention_factor, rope_frequencies

HIGHEST = jax.lax.Precision.HIGHEST


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, tile: int) -> jax.Array:
    """Causal softmax(q k^T / sqrt(D)) v of q [T, H, D] over k, v [T, KH, D] (T a multiple of `tile`,
    query heads grouped over K/V heads): query tile i reads key tiles 0..i, with a running max and sum."""
    t, h, d = q.shape
    kh = k.shape[1]
    g, n = h // kh, t // tile
    qt = (q.astype(jnp.float32) * d**-0.5).reshape(n, tile, kh, g, d)
    kt, vt = k.reshape(n, tile, kh, d), v.reshape(n, tile, kh, d)
    below = jnp.arange(tile)[None, :] <= jnp.arange(tile)[:, None]  # [query, key] within the diagonal tile

    def row(i: jax.Array) -> jax.Array:
        qi = qt[i]

        def body(j: jax.Array, carry: tuple) -> tuple:
            m, l, acc = carry
            s = jnp.einsum("qkgd,skd->kgqs", qi, kt[j], precision=HIGHEST)
            s = jnp.where((j < i) | below, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            p, c = jnp.exp(s - m_new[..., None]), jnp.exp(m - m_new)
            acc = acc * c[..., None] + jnp.einsum("kgqs,skd->kgqd", p, vt[j], precision=HIGHEST)
            return m_new, l * c + p.sum(-1), acc

        init = (jnp.full((kh, g, tile), -jnp.inf), jnp.zeros((kh, g, tile)), jnp.zeros((kh, g, tile, d)))
        _, l, acc = jax.lax.fori_loop(0, i + 1, body, init)
        return jnp.moveaxis(acc / l[..., None], 2, 0).reshape(tile, h, d)

    return jax.lax.map(row, jnp.arange(n)).reshape(t, h, d).astype(q.dtype)


def one_query_attention(q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array) -> jax.Array:
    """Attention of one query [H, D] at position `pos` over the keys at positions <= pos of k, v [S, KH, D]."""
    h, d = q.shape
    s, kh = k.shape[:2]
    qg = q.astype(jnp.float32).reshape(kh, h // kh, d) * d**-0.5
    scores = jnp.einsum("kgd,skd->kgs", qg, k, precision=HIGHEST)
    weights = jax.nn.softmax(jnp.where(jnp.arange(s) <= pos, scores, -jnp.inf), axis=-1)
    return jnp.einsum("kgs,skd->kgd", weights, v, precision=HIGHEST).reshape(h, d).astype(q.dtype)


def _project(layer: DecoderLayer, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A layer's rotated q, k and v [T, heads, D] of hidden states x [1, T, E]."""
    attn = layer.attn
    cfg = attn.cfg
    h = layer.input_norm(x)[0]
    q, k, v = (jnp.einsum("te,ehd->thd", h, w[...]) for w in (attn.q_proj, attn.k_proj, attn.v_proj))
    inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, positions[None])
    scale = attention_factor(cfg.rope_scaling)
    q, k = (apply_rope(a[None], positions[None], inv_freq, scale)[0] for a in (q, k))
    return q, k, v


def _finish(layer: DecoderLayer, x: jax.Array, heads: jax.Array) -> jax.Array:
    """The rest of a decoder layer after attention: output projection, residual, MLP, residual."""
    x = x + layer.attn.project(heads[None])
    return x + layer.mlp(layer.post_attn_norm(x))


def greedy_reference(model: LlamaModel, prompt: list[int], max_tokens: int, tile: int = 512) -> list[int]:
    """`max_tokens` greedy tokens after `prompt`: the whole prompt in one forward (tiled exact attention),
    then one token per forward over contiguous per-layer K/V. A plain Llama layer only (no biases,
    QK norm, sliding window, soft-capping or experts): a ValueError otherwise."""
    cfg = model.cfg
    if cfg.qkv_bias or cfg.o_bias or cfg.qk_norm or cfg.sliding_window or cfg.attn_logit_softcap or cfg.num_experts:
        raise ValueError("greedy_reference runs plain Llama layers only")
    n = len(prompt)
    padded = -(-n // tile) * tile
    graphdef, state = nnx.split(model)
    ids = np.zeros(padded, np.int32)
    ids[:n] = prompt

    @jax.jit
    def prefill(state: nnx.State, ids: jax.Array) -> tuple[jax.Array, list]:
        m = nnx.merge(graphdef, state)
        x = m.embed_tokens(ids[None])
        positions = jnp.arange(padded, dtype=jnp.int32)
        caches = []
        for layer in m.layers:
            q, k, v = _project(layer, x, positions)
            x = _finish(layer, x, causal_attention(q, k, v, tile))
            grow = ((0, max_tokens), (0, 0), (0, 0))
            caches.append((jnp.pad(k, grow), jnp.pad(v, grow)))  # pad tokens' K/V: overwritten or masked
        return m.logits(m.norm(x[0, n - 1])), caches

    @jax.jit
    def decode(state: nnx.State, token: jax.Array, pos: jax.Array, caches: list) -> tuple[jax.Array, list]:
        m = nnx.merge(graphdef, state)
        x = m.embed_tokens(token.reshape(1, 1))
        new = []
        for layer, (kc, vc) in zip(m.layers, caches):
            q, k, v = _project(layer, x, pos.reshape(1))
            kc, vc = kc.at[pos].set(k[0]), vc.at[pos].set(v[0])
            x = _finish(layer, x, one_query_attention(q[0], kc, vc, pos)[None])
            new.append((kc, vc))
        return m.logits(m.norm(x[0, 0])), new

    logits, caches = prefill(state, jnp.asarray(ids))
    out = [int(jnp.argmax(logits))]
    for pos in range(n, n + max_tokens - 1):
        logits, caches = decode(state, jnp.int32(out[-1]), jnp.int32(pos), caches)
        out.append(int(jnp.argmax(logits)))
    return out
