"""The Llama family's building blocks (Flax NNX): RMSNorm, attention with RoPE and GQA, the gated MLP,
and the decoder layer that holds them (its MLP a mixture of experts on MoE layers)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jaxinfra.config import ModelConfig
from jaxinfra.models.mixed_precision import add_bias, scale, weight_einsum
from jaxinfra.models.moe import MoE, RouterStats
from jaxinfra.models.multi_lora import MultiLora, maybe_add
from jaxinfra.models.options import ForwardOptions
from jaxinfra.models.params import normal_param, zeros_param
from jaxinfra.models.rope import apply_rope, attention_factor, rope_frequencies
from jaxinfra.models.sharded_attention import cached_attention, dense_attention
from jaxinfra.quant.qlinear import Weight, linear
from pallas_kernels import AttentionMetadata, DenseMetadata, KVCache, PagedKVCache, attend
from sharding import constrain


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, with the statistics in float32."""

    def __init__(self, dim: int, eps: float, axis: str, dtype: str) -> None:
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype), logical_axes=(axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return scale(y.astype(x.dtype), self.scale[...])


class Attention(nnx.Module):
    """Grouped-query self-attention; K/V storage and lookup are delegated to pallas_kernels.attend."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, attn_impl: str | None = None) -> None:
        e, h, kh, d, std, dt = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.initializer_range,
            cfg.dtype,
        )
        self.cfg = cfg
        self.attn_impl = attn_impl
        self.q_proj = normal_param(rngs, (e, h, d), ("embed", "heads", "head_dim"), std, dt)
        self.k_proj = normal_param(rngs, (e, kh, d), ("embed", "kv_heads", "head_dim"), std, dt)
        self.v_proj = normal_param(rngs, (e, kh, d), ("embed", "kv_heads", "head_dim"), std, dt)
        self.o_proj = normal_param(rngs, (h, d, e), ("heads", "head_dim", "embed"), std, dt)
        if cfg.qkv_bias:
            self.q_bias = zeros_param((h, d), ("heads", "head_dim"), dt)
            self.k_bias = zeros_param((kh, d), ("kv_heads", "head_dim"), dt)
            self.v_bias = zeros_param((kh, d), ("kv_heads", "head_dim"), dt)
        if cfg.o_bias:
            self.o_bias = zeros_param((e,), ("embed",), dt)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, "head_dim", dt)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, "head_dim", dt)

    q_proj: Weight
    k_proj: Weight
    v_proj: Weight
    o_proj: Weight

    def _qkv(
        self, x: Float[Array, "B T E"], options: ForwardOptions, lora: MultiLora | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Q, K, V projections (with `lora`'s deltas); `fused` into one matmul over [E, KV heads, group + 2, D]
        (Megatron's layout, sharded over KV heads), so tensor parallelism reduces the input gradient once,
        not three times."""
        wq, wk, wv, key = self.q_proj, self.k_proj, self.v_proj, options.dropout_key
        if lora is not None or not (
            options.fused_projections
            and isinstance(wq, nnx.Param)
            and isinstance(wk, nnx.Param)
            and isinstance(wv, nnx.Param)
        ):
            q, k, v = (linear("bte,ehd->bthd", x, w, key) for w in (wq, wk, wv))
            return maybe_add(lora, "q_proj", x, q), maybe_add(lora, "k_proj", x, k), maybe_add(lora, "v_proj", x, v)
        kh, group = self.cfg.num_kv_heads, self.cfg.num_heads // self.cfg.num_kv_heads
        q = wq[...].reshape(x.shape[-1], kh, group, -1)
        w = jnp.concatenate([q, wk[...][:, :, None], wv[...][:, :, None]], axis=2)
        out = weight_einsum("bte,ekgd->btkgd", x, w, names=("embed", "kv_heads", None, "head_dim"))
        b, t = x.shape[:2]
        return out[:, :, :, :group].reshape(b, t, kh * group, -1), out[:, :, :, group], out[:, :, :, group + 1]

    def heads(
        self,
        x: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        metadata: AttentionMetadata,
        cache: KVCache | PagedKVCache | None,
        options: ForwardOptions = ForwardOptions(),
        lora: MultiLora | None = None,
    ) -> tuple[Float[Array, "B T H D"], KVCache | PagedKVCache | None]:
        """Per-head attention output, before the output projection (what o_proj sees)."""
        q, k, v = self._qkv(x, options, lora)
        if self.cfg.qkv_bias:
            q, k, v = add_bias(q, self.q_bias[...]), add_bias(k, self.k_bias[...]), add_bias(v, self.v_bias[...])
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cfg = self.cfg
        inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, positions)
        scale = attention_factor(cfg.rope_scaling)
        q, k = apply_rope(q, positions, inv_freq, scale), apply_rope(k, positions, inv_freq, scale)
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        # every key and value of the row on each device: with the sequence split over the context
        # axis this is one all-gather of K and one of V per layer (context parallelism)
        k = constrain(k, ("batch", None, "kv_heads", "head_dim"))
        v = constrain(v, ("batch", None, "kv_heads", "head_dim"))
        common: dict[str, Any] = dict(sliding_window=self.cfg.sliding_window, logit_softcap=self.cfg.attn_logit_softcap)
        if isinstance(metadata, DenseMetadata) and cache is None:  # whole rows: sharded by the active rules
            seg, causal, zigzag = metadata.segment_ids, metadata.causal, options.zigzag
            return dense_attention(q, k, v, seg, causal=causal, zigzag=zigzag, impl=self.attn_impl, **common), None
        if cache is None:
            return attend(q, k, v, metadata, cache, impl=self.attn_impl, **common)
        return cached_attention(q, k, v, metadata, cache, impl=self.attn_impl, **common)

    def __call__(
        self,
        x: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        metadata: AttentionMetadata,
        cache: KVCache | PagedKVCache | None,
        options: ForwardOptions = ForwardOptions(),
        lora: MultiLora | None = None,
    ) -> tuple[Float[Array, "B T E"], KVCache | PagedKVCache | None]:
        out, cache = self.heads(x, positions, metadata, cache, options, lora)
        return self.project(out, options.dropout_key, lora), cache

    def project(
        self, out: Float[Array, "B T H D"], key: jax.Array | None = None, lora: MultiLora | None = None
    ) -> Float[Array, "B T E"]:
        """The output projection (with `lora`'s delta, and its bias) of per-head attention outputs (`key`:
        LoRA dropout's)."""
        y = maybe_add(lora, "o_proj", out, linear("bthd,hde->bte", out, self.o_proj, key))
        return add_bias(y, self.o_bias[...]) if self.cfg.o_bias else y


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)); `width` overrides intermediate_size."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, width: int | None = None) -> None:
        e, m, std, dt = cfg.hidden_size, width or cfg.intermediate_size, cfg.initializer_range, cfg.dtype
        self.gate_proj = normal_param(rngs, (e, m), ("embed", "mlp"), std, dt)
        self.up_proj = normal_param(rngs, (e, m), ("embed", "mlp"), std, dt)
        self.down_proj = normal_param(rngs, (m, e), ("mlp", "embed"), std, dt)

    gate_proj: Weight
    up_proj: Weight
    down_proj: Weight

    def hidden(
        self, x: Float[Array, "B T E"], options: ForwardOptions = ForwardOptions(), lora: MultiLora | None = None
    ) -> Float[Array, "B T M"]:
        """silu(gate(x)) * up(x): what down_proj sees (gate and up as one matmul with fused_projections and
        without adapters; `lora`: with each token's adapter deltas)."""
        wg, wu, key = self.gate_proj, self.up_proj, options.dropout_key
        if lora is None and options.fused_projections and isinstance(wg, nnx.Param) and isinstance(wu, nnx.Param):
            out = weight_einsum("bte,ecm->btcm", x, jnp.stack([wg[...], wu[...]], axis=1), names=("embed", None, "mlp"))
            gate, up = out[:, :, 0], out[:, :, 1]
        else:
            gate, up = linear("bte,em->btm", x, wg, key), linear("bte,em->btm", x, wu, key)
            gate, up = maybe_add(lora, "gate_proj", x, gate), maybe_add(lora, "up_proj", x, up)
        return constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))

    def __call__(
        self, x: Float[Array, "B T E"], options: ForwardOptions = ForwardOptions(), lora: MultiLora | None = None
    ) -> Float[Array, "B T E"]:
        h = self.hidden(x, options, lora)
        return maybe_add(lora, "down_proj", h, linear("btm,me->bte", h, self.down_proj, options.dropout_key))


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then MLP (or mixture of experts, by the config and `index`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, attn_impl: str | None = None, index: int = 0) -> None:
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", cfg.dtype)
        self.attn = Attention(cfg, rngs, attn_impl)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", cfg.dtype)
        self.mlp = feed_forward(cfg, rngs, index)

    def __call__(
        self,
        x: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        metadata: AttentionMetadata,
        cache: KVCache | PagedKVCache | None,
        options: ForwardOptions = ForwardOptions(),
        valid: Bool[Array, "B T"] | None = None,
        lora: MultiLora | None = None,
    ) -> tuple[Float[Array, "B T E"], KVCache | PagedKVCache | None, RouterStats | None]:
        """The layer's output, its updated cache, and its router's stats (MoE layers, when
        options.router_stats; counting the `valid` tokens, all when None). `lora`: this layer's adapter
        pools and each token's slot (dense MLPs only: a mixture of experts takes none)."""
        h, cache = self.attn(self.input_norm(x), positions, metadata, cache, options, lora)
        x = x + h
        stats = None
        if isinstance(self.mlp, MoE):
            h, stats = self.mlp(self.post_attn_norm(x), options, valid)
        else:
            h = self.mlp(self.post_attn_norm(x), options, lora)
        return constrain(x + h, ("batch", "length", "embed")), cache, stats


def feed_forward(cfg: ModelConfig, rngs: nnx.Rngs, index: int) -> MLP | MoE:
    """Layer `index`'s MLP, or its mixture of experts (with Qwen2-MoE's shared expert, an MLP)."""
    if not cfg.is_moe_layer(index):
        return MLP(cfg, rngs)
    width = cfg.shared_expert_intermediate_size
    return MoE(cfg, rngs, MLP(cfg, rngs, width) if width else None)
