"""One Flax NNX decoder for the Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3) and its
mixture-of-experts kin (Mixtral, Qwen2-MoE, Qwen3-MoE), set by ModelConfig."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util
from jaxtyping import Array, Float, Int

from jaxinfra.config import ModelConfig
from jaxinfra.models.mixed_precision import add_bias, scale, weight_einsum
from jaxinfra.models.moe import MoE, collect, emit
from jaxinfra.models.rope import apply_rope, inverse_frequencies
from jaxinfra.models.sharded_attention import cached_attention, dense_attention
from jaxinfra.quant.qlinear import Weight, linear
from pallas_kernels import AttentionMetadata, DenseMetadata, KVCache, PagedKVCache, PagedMetadata, attend
from sharding import constrain

_FUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("fused_projections", default=False)


@contextlib.contextmanager
def fused_projections() -> Iterator[None]:
    """Within: dense Q/K/V and gate/up projections run as one matmul each (weights joined at trace
    time). For training, where the join is cheap next to the step; decoding would read the weights twice."""
    token = _FUSED.set(True)
    try:
        yield
    finally:
        _FUSED.reset(token)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float, dtype: str) -> nnx.Param:
    """A normally initialised parameter that carries its logical axis names."""
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=axes)


def _zeros(shape: tuple[int, ...], axes: tuple[str, ...], dtype: str) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


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
        self.q_proj = _param(rngs, (e, h, d), ("embed", "heads", "head_dim"), std, dt)
        self.k_proj = _param(rngs, (e, kh, d), ("embed", "kv_heads", "head_dim"), std, dt)
        self.v_proj = _param(rngs, (e, kh, d), ("embed", "kv_heads", "head_dim"), std, dt)
        self.o_proj = _param(rngs, (h, d, e), ("heads", "head_dim", "embed"), std, dt)
        if cfg.qkv_bias:
            self.q_bias = _zeros((h, d), ("heads", "head_dim"), dt)
            self.k_bias = _zeros((kh, d), ("kv_heads", "head_dim"), dt)
            self.v_bias = _zeros((kh, d), ("kv_heads", "head_dim"), dt)
        if cfg.o_bias:
            self.o_bias = _zeros((e,), ("embed",), dt)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, "head_dim", dt)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, "head_dim", dt)

    q_proj: Weight
    k_proj: Weight
    v_proj: Weight
    o_proj: Weight

    def _qkv(self, x: Float[Array, "B T E"]) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Q, K, V projections; fused into one matmul over [E, KV heads, group + 2, D] (Megatron's
        layout, sharded over KV heads) when fused_projections is on, so tensor parallelism reduces
        the input gradient once instead of three times."""
        wq, wk, wv = self.q_proj, self.k_proj, self.v_proj
        if not (_FUSED.get() and isinstance(wq, nnx.Param) and isinstance(wk, nnx.Param) and isinstance(wv, nnx.Param)):
            return linear("bte,ehd->bthd", x, wq), linear("bte,ehd->bthd", x, wk), linear("bte,ehd->bthd", x, wv)
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
    ) -> tuple[Float[Array, "B T H D"], KVCache | PagedKVCache | None]:
        """Per-head attention output, before the output projection (what o_proj sees)."""
        q, k, v = self._qkv(x)
        if self.cfg.qkv_bias:
            q, k, v = add_bias(q, self.q_bias[...]), add_bias(k, self.k_bias[...]), add_bias(v, self.v_bias[...])
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = inverse_frequencies(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        # every key and value of the row on each device: with the sequence split over the context
        # axis this is one all-gather of K and one of V per layer (context parallelism)
        k = constrain(k, ("batch", None, "kv_heads", "head_dim"))
        v = constrain(v, ("batch", None, "kv_heads", "head_dim"))
        options: dict[str, Any] = dict(
            sliding_window=self.cfg.sliding_window, logit_softcap=self.cfg.attn_logit_softcap
        )
        if isinstance(metadata, DenseMetadata) and cache is None:  # whole rows: sharded by the active rules
            out = dense_attention(q, k, v, metadata.segment_ids, causal=metadata.causal, impl=self.attn_impl, **options)
            return out, None
        if cache is None:
            return attend(q, k, v, metadata, cache, impl=self.attn_impl, **options)
        return cached_attention(q, k, v, metadata, cache, impl=self.attn_impl, **options)

    def __call__(
        self,
        x: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        metadata: AttentionMetadata,
        cache: KVCache | PagedKVCache | None,
    ) -> tuple[Float[Array, "B T E"], KVCache | PagedKVCache | None]:
        out, cache = self.heads(x, positions, metadata, cache)
        return self.project(out), cache

    def project(self, out: Float[Array, "B T H D"]) -> Float[Array, "B T E"]:
        """The output projection (and its bias) of per-head attention outputs."""
        y = linear("bthd,hde->bte", out, self.o_proj)
        return add_bias(y, self.o_bias[...]) if self.cfg.o_bias else y


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)); `width` overrides intermediate_size."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, width: int | None = None) -> None:
        e, m, std, dt = cfg.hidden_size, width or cfg.intermediate_size, cfg.initializer_range, cfg.dtype
        self.gate_proj = _param(rngs, (e, m), ("embed", "mlp"), std, dt)
        self.up_proj = _param(rngs, (e, m), ("embed", "mlp"), std, dt)
        self.down_proj = _param(rngs, (m, e), ("mlp", "embed"), std, dt)

    gate_proj: Weight
    up_proj: Weight
    down_proj: Weight

    def hidden(self, x: Float[Array, "B T E"]) -> Float[Array, "B T M"]:
        """silu(gate(x)) * up(x): what down_proj sees (gate and up as one matmul when fused)."""
        if _FUSED.get() and isinstance(self.gate_proj, nnx.Param) and isinstance(self.up_proj, nnx.Param):
            w = jnp.stack([self.gate_proj[...], self.up_proj[...]], axis=1)
            out = weight_einsum("bte,ecm->btcm", x, w, names=("embed", None, "mlp"))
            gate, up = out[:, :, 0], out[:, :, 1]
        else:
            gate, up = linear("bte,em->btm", x, self.gate_proj), linear("bte,em->btm", x, self.up_proj)
        return constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))

    def __call__(self, x: Float[Array, "B T E"]) -> Float[Array, "B T E"]:
        return linear("btm,me->bte", self.hidden(x), self.down_proj)


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
    ) -> tuple[Float[Array, "B T E"], KVCache | PagedKVCache | None]:
        h, cache = self.attn(self.input_norm(x), positions, metadata, cache)
        x = x + h
        x = x + self.mlp(self.post_attn_norm(x))
        return constrain(x, ("batch", "length", "embed")), cache


def feed_forward(cfg: ModelConfig, rngs: nnx.Rngs, index: int) -> MLP | MoE:
    """Layer `index`'s MLP, or its mixture of experts (with Qwen2-MoE's shared expert, an MLP)."""
    if not cfg.is_moe_layer(index):
        return MLP(cfg, rngs)
    width = cfg.shared_expert_intermediate_size
    return MoE(cfg, rngs, MLP(cfg, rngs, width) if width else None)


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """Decoder-layer parameters stacked on a leading axis (pure dicts), with one layer's graph to run a slice."""

    graphdef: nnx.GraphDef
    template: list  # one layer's flat state: (path, variable) pairs
    params: dict

    @classmethod
    def of(cls, layers: nnx.List) -> LayerStack:
        graphdef, template = layer_graph(layers)  # refuses differing layers before stacking them
        return cls(graphdef, template, _stack_trees([nnx.to_pure_dict(nnx.state(layer)) for layer in layers]))

    def layer(self, params: dict) -> DecoderLayer:
        """The layer whose parameters are `params` (one slice of the stack)."""
        return merge_params(self.graphdef, self.template, params)


def layer_graph(layers: nnx.List) -> tuple[nnx.GraphDef, list]:
    """The one graph and flat state template (path, variable) pairs that every layer shares; a
    ValueError if the layers differ (then they cannot be scanned)."""
    graphdef, state = nnx.split(layers[0])
    if any(nnx.graphdef(layer) != graphdef for layer in layers):
        raise ValueError("scanned layers must be identical (a partly quantized model cannot be scanned)")
    return graphdef, list(nnx.to_flat_state(state))


def paged_layer_view(
    metadata: PagedMetadata, layer: Int[Array, ""] | int, blocks_per_layer: int, block_size: int
) -> PagedMetadata:
    """Metadata for one layer of a paged pool stacked on a `layers` axis and flattened to
    [layers x blocks, ...]: the layer's block ids (tables, tile-plan pages, slots) offset to its blocks."""
    offset = layer * blocks_per_layer
    slots = metadata.slot_mapping
    plan = metadata.plan
    if plan is not None:
        plan = dataclasses.replace(plan, pages=plan.pages + offset)
    return dataclasses.replace(
        metadata,
        slot_mapping=jnp.where(slots < 0, slots, slots + offset * block_size),
        block_tables=metadata.block_tables + offset,
        plan=plan,
    )


def row_positions(input_ids: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """Positions 0 .. T - 1 of every row (unpacked rows without explicit positions)."""
    b, t = input_ids.shape
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def merge_params(graphdef: nnx.GraphDef, template: Iterable[Any], params: dict) -> Any:
    """The module of `graphdef` whose variables (flat `template`: (path, variable) pairs) hold the
    values of the pure dict `params`."""
    flat = traverse_util.flatten_dict(params)
    return nnx.merge(graphdef, nnx.from_flat_state([(p, v.replace(value=flat[p])) for p, v in template]))


def _stack_trees(trees: list) -> Any:
    """Equal-structured trees -> one tree of leaves stacked on a new leading axis (shapes alone too,
    for a model built with nnx.eval_shape)."""

    def stack(*xs: Any) -> Any:
        if isinstance(xs[0], jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
        return jnp.stack(xs)

    return jax.tree.map(stack, *trees)


def stack_layers(params: dict) -> dict:
    """Pure-dict params with one entry per layer (params["layers"][i]) -> each weight stacked [L, ...]."""
    layers = params["layers"]
    return {**params, "layers": _stack_trees([layers[i] for i in range(len(layers))])}


def unstack_layers(params: dict, num_layers: int) -> dict:
    """The inverse of stack_layers."""
    stacked = params["layers"]
    return {**params, "layers": {i: jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(num_layers)}}


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.checkpoint_dots,
}


def _layer_call(
    layer: DecoderLayer,
    x: jax.Array,
    positions: jax.Array,
    metadata: AttentionMetadata,
    cache: KVCache | PagedKVCache | None,
) -> tuple[tuple[jax.Array, KVCache | PagedKVCache | None], Any]:
    """One layer, its MoE router statistics handed out (it may run under remat)."""
    return collect(lambda: layer(x, positions, metadata, cache))


class LlamaModel(nnx.Module):
    """Decoder-only LM. `model(input_ids)` -> float32 logits; `forward` also threads KV caches.

    `remat` ("none", "full", "save_dots") recomputes each decoder layer in the backward pass.
    `scan_layers` runs the cache-free forward (training, scoring) as one `lax.scan` over the layers'
    parameters stacked at trace time: one layer body in the compiled program, whatever the depth.
    Parameters stay one module per layer, so checkpoints and HF import/export do not change."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, attn_impl: str | None = None) -> None:
        self.cfg = cfg
        self.remat = "none"
        self.scan_layers = False
        self.compute_dtype: str | None = None  # activations' dtype when the weights are kept float32
        std, dt = cfg.initializer_range, cfg.dtype
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), std, dt)
        self.layers = nnx.List([DecoderLayer(cfg, rngs, attn_impl, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", dt)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), std, dt)

    def hidden_states(
        self,
        input_ids: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        metadata: AttentionMetadata,
        caches: list[KVCache] | list[PagedKVCache] | PagedKVCache | None = None,
        layer_stack: LayerStack | None = None,
    ) -> tuple[Float[Array, "B T E"], list | PagedKVCache | None]:
        """Final-norm hidden states (before the LM head) and the updated per-layer caches (or the
        one paged pool of every layer, see run_paged_layers).
        `layer_stack`: run the layers from these stacked parameters instead of self.layers (scanned)."""
        x = self.embed_tokens(input_ids)
        if isinstance(caches, PagedKVCache):
            if not isinstance(metadata, PagedMetadata):
                raise ValueError("a stacked paged KV pool needs PagedMetadata")
            x, pool = self.run_paged_layers(x, positions, metadata, caches, layer_stack)
            return self.norm(x), pool
        if layer_stack is not None or (self.scan_layers and caches is None):
            return self.norm(self.run_layers(x, positions, metadata, layer_stack)), None
        new_caches: list | None = [] if caches is not None else None
        call = _layer_call if self.remat == "none" else nnx.remat(_layer_call, policy=REMAT_POLICIES[self.remat])
        for i, layer in enumerate(self.layers):
            (x, cache), stats = call(layer, x, positions, metadata, None if caches is None else caches[i])
            emit(stats)
            if new_caches is not None:
                new_caches.append(cache)
        return self.norm(x), new_caches

    def embed_tokens(self, input_ids: Int[Array, "B T"]) -> Float[Array, "B T E"]:
        """Embedding rows, cast to `compute_dtype` when the weights are float32 masters."""
        x = jnp.take(self.embed[...], input_ids, axis=0)
        x = x if self.compute_dtype is None else x.astype(self.compute_dtype)
        return constrain(x, ("batch", "length", "embed"))

    def run_layers(
        self,
        x: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        metadata: AttentionMetadata,
        stack: LayerStack | None = None,
    ) -> Float[Array, "B T E"]:
        """The decoder stack as one scan over layer parameters stacked on a leading `layers` axis
        (`stack`, or this model's layers stacked at trace time)."""
        stack = stack or LayerStack.of(self.layers)

        def body(h: jax.Array, params: dict) -> tuple[jax.Array, Any]:
            (out, _), stats = collect(lambda: stack.layer(params)(h, positions, metadata, None))
            return out, stats

        if self.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.remat])
        x, stats = jax.lax.scan(body, x, stack.params)
        emit(stats)
        return x

    def run_paged_layers(
        self,
        x: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        metadata: PagedMetadata,
        pool: PagedKVCache,
        stack: LayerStack | None = None,
    ) -> tuple[Float[Array, "B T E"], PagedKVCache]:
        """Serving's decoder stack over one paged pool for all layers ([L, blocks, block size, KV heads,
        D]): each layer reads and writes its own blocks of the pool flattened to [L x blocks, ...].
        With `stack`, one lax.scan (one layer body compiled, whatever the depth); else a loop over
        self.layers (layers that differ, e.g. partly quantized)."""
        num_layers, blocks, block_size = pool.k.shape[:3]
        flat = jax.tree.map(lambda a: a.reshape(num_layers * blocks, *a.shape[2:]), pool)

        def run(layer: DecoderLayer, h: jax.Array, i: Any, cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
            out, new = layer(h, positions, paged_layer_view(metadata, i, blocks, block_size), cache)
            assert isinstance(new, PagedKVCache)
            return out, new

        if stack is None:
            for i, layer in enumerate(self.layers):
                x, flat = run(layer, x, i, flat)
        else:

            def body(carry: tuple, xs: tuple) -> tuple[tuple, Any]:
                (h, cache), (params, i) = carry, xs
                return collect(lambda: run(stack.layer(params), h, i, cache))

            (x, flat), stats = jax.lax.scan(body, (x, flat), (stack.params, jnp.arange(num_layers, dtype=jnp.int32)))
            emit(stats)
        return x, jax.tree.map(lambda a: a.reshape(num_layers, blocks, *a.shape[1:]), flat)

    def logits(self, h: Float[Array, "... E"]) -> Float[Array, "... V"]:
        """LM head (tied to the embedding when configured), float32 output."""
        rows = h.reshape(-1, h.shape[-1])
        if self.cfg.tie_word_embeddings:
            logits = weight_einsum("ne,ve->nv", rows, self.embed[...], jnp.float32)
        else:
            logits = weight_einsum("ne,ev->nv", rows, self.lm_head[...], jnp.float32)
        return logits.reshape(*h.shape[:-1], logits.shape[-1])

    def forward(
        self,
        input_ids: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        metadata: AttentionMetadata,
        caches: list[KVCache] | list[PagedKVCache] | PagedKVCache | None = None,
        layer_stack: LayerStack | None = None,
    ) -> tuple[Float[Array, "B T V"], list | PagedKVCache | None]:
        h, caches = self.hidden_states(input_ids, positions, metadata, caches, layer_stack)
        return self.logits(h), caches

    def __call__(
        self,
        input_ids: Int[Array, "B T"],
        segment_ids: Int[Array, "B T"] | None = None,
        positions: Int[Array, "B T"] | None = None,
        layer_stack: LayerStack | None = None,
    ) -> Float[Array, "B T V"]:
        """Causal forward over whole rows (optionally packed: segment ids and per-document positions)."""
        if positions is None:
            positions = row_positions(input_ids)
        logits, _ = self.forward(input_ids, positions, DenseMetadata(segment_ids=segment_ids), None, layer_stack)
        return logits

    def init_caches(self, batch: int, max_len: int, dtype: str | None = None) -> list[KVCache]:
        """Zeroed contiguous KV caches, one per layer."""
        cfg = self.cfg
        return [
            KVCache.zeros(batch, max_len, cfg.num_kv_heads, cfg.head_dim, jnp.dtype(dtype or cfg.dtype))
            for _ in range(cfg.num_layers)
        ]
