"""One Flax NNX decoder for the Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3) and its
mixture-of-experts kin (Mixtral, Qwen2-MoE, Qwen3-MoE), set by ModelConfig."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util
from jaxtyping import Array, Bool, Float, Int

from jaxinfra.config import ModelConfig
from jaxinfra.models.families import family
from jaxinfra.models.layers import DecoderLayer, RMSNorm
from jaxinfra.models.mixed_precision import weight_einsum
from jaxinfra.models.moe import RouterStats, summarize
from jaxinfra.models.multi_lora import MultiLora
from jaxinfra.models.options import REMAT_POLICIES, ForwardOptions
from jaxinfra.models.params import normal_param
from pallas_kernels import AttentionMetadata, DenseMetadata, KVCache, PagedKVCache, PagedMetadata
from sharding import constrain


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


def _summary(stats: list[RouterStats | None]) -> RouterStats | None:
    """The model's RouterStats from its layers' (or scanned stacks') stats; None without any."""
    return summarize([x for x in stats if x is not None])


class LlamaModel(nnx.Module):
    """Decoder-only LM. `model(input_ids)` -> float32 logits; `forward` also threads KV caches.

    How it runs (fused projections, remat, compute dtype, MoE capacity and statistics, zigzag context
    parallelism) is the ForwardOptions each call passes. `scan_layers` runs the cache-free forward
    (training, scoring) as one `lax.scan` over the layers' parameters stacked at trace time: one layer
    body in the compiled program, whatever the depth.
    Parameters stay one module per layer, so checkpoints and HF import/export do not change."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, attn_impl: str | None = None) -> None:
        self.cfg = cfg
        self.scan_layers = False
        std, dt = cfg.initializer_range, cfg.dtype
        self.embed = normal_param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), std, dt)
        block = family(cfg.model_type).block
        self.layers = nnx.List([block(cfg, rngs, attn_impl, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", dt)
        if not cfg.tie_word_embeddings:
            self.lm_head = normal_param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), std, dt)

    def hidden_states(
        self,
        input_ids: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        metadata: AttentionMetadata,
        caches: list[KVCache] | list[PagedKVCache] | PagedKVCache | None = None,
        layer_stack: LayerStack | None = None,
        options: ForwardOptions = ForwardOptions(),
        valid: Bool[Array, "B T"] | None = None,
        lora: MultiLora | None = None,
    ) -> tuple[Float[Array, "B T E"], list | PagedKVCache | None, RouterStats | None]:
        """Final-norm hidden states (before the LM head), the updated per-layer caches (or the one paged
        pool of every layer, see run_paged_layers), and with options.router_stats the MoE router's
        statistics over the `valid` tokens (all when None). `layer_stack`: run the layers from these
        stacked parameters instead of self.layers (scanned). `lora`: each token's adapter (multi-LoRA)."""
        x = self.embed_tokens(input_ids, options.compute_dtype)
        if isinstance(caches, PagedKVCache):
            if not isinstance(metadata, PagedMetadata):
                raise ValueError("a stacked paged KV pool needs PagedMetadata")
            x, pool, stats = self.run_paged_layers(x, positions, metadata, caches, layer_stack, options, valid, lora)
            return self.norm(x), pool, _summary([stats])
        if layer_stack is not None or (self.scan_layers and caches is None):
            x, stats = self.run_layers(x, positions, metadata, layer_stack, options, valid, lora)
            return self.norm(x), None, _summary([stats])
        new_caches: list | None = [] if caches is not None else None

        def call(
            layer: DecoderLayer, x: jax.Array, metadata: AttentionMetadata, cache: Any, valid: Any, lora: Any
        ) -> Any:
            return layer(x, positions, metadata, cache, options, valid, lora)

        if options.remat != "none":
            call = nnx.remat(call, policy=REMAT_POLICIES[options.remat])
        layer_stats = []
        for i, layer in enumerate(self.layers):
            layer_lora = None if lora is None else lora.layer(i)
            x, cache, stats = call(layer, x, metadata, None if caches is None else caches[i], valid, layer_lora)
            layer_stats.append(stats)
            if new_caches is not None:
                new_caches.append(cache)
        return self.norm(x), new_caches, _summary(layer_stats)

    def embed_tokens(self, input_ids: Int[Array, "B T"], compute_dtype: str | None = None) -> Float[Array, "B T E"]:
        """Embedding rows, cast to `compute_dtype` when the weights are float32 masters."""
        x = jnp.take(self.embed[...], input_ids, axis=0)
        x = x if compute_dtype is None else x.astype(compute_dtype)
        return constrain(x, ("batch", "length", "embed"))

    def run_layers(
        self,
        x: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        metadata: AttentionMetadata,
        stack: LayerStack | None = None,
        options: ForwardOptions = ForwardOptions(),
        valid: Bool[Array, "B T"] | None = None,
        lora: MultiLora | None = None,
    ) -> tuple[Float[Array, "B T E"], RouterStats | None]:
        """The decoder stack as one scan over layer parameters stacked on a leading `layers` axis
        (`stack`, or this model's layers stacked at trace time), and its router stats stacked [L, ...]."""
        stack = stack or LayerStack.of(self.layers)

        def body(h: jax.Array, xs: tuple) -> tuple[jax.Array, RouterStats | None]:
            params, i = xs
            layer_lora = None if lora is None else lora.layer(i)
            out, _, stats = stack.layer(params)(h, positions, metadata, None, options, valid, layer_lora)
            return out, stats

        if options.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[options.remat])
        depth = jax.tree.leaves(stack.params)[0].shape[0]  # a pipeline stage scans only its layers
        return jax.lax.scan(body, x, (stack.params, jnp.arange(depth, dtype=jnp.int32)))

    def run_paged_layers(
        self,
        x: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        metadata: PagedMetadata,
        pool: PagedKVCache,
        stack: LayerStack | None = None,
        options: ForwardOptions = ForwardOptions(),
        valid: Bool[Array, "B T"] | None = None,
        lora: MultiLora | None = None,
    ) -> tuple[Float[Array, "B T E"], PagedKVCache, RouterStats | None]:
        """Serving's decoder stack over one paged pool for all layers ([L, blocks, block size, KV heads,
        D]): each layer reads and writes its own blocks of the pool flattened to [L x blocks, ...].
        With `stack`, one lax.scan (one layer body compiled, whatever the depth); else a loop over
        self.layers (layers that differ, e.g. partly quantized). Also the router stats (see hidden_states)."""
        num_layers, blocks, block_size = pool.k.shape[:3]
        flat = jax.tree.map(lambda a: a.reshape(num_layers * blocks, *a.shape[2:]), pool)

        def run(
            layer: DecoderLayer, h: jax.Array, i: Any, cache: PagedKVCache
        ) -> tuple[jax.Array, PagedKVCache, RouterStats | None]:
            view = paged_layer_view(metadata, i, blocks, block_size)
            out, new, stats = layer(h, positions, view, cache, options, valid, None if lora is None else lora.layer(i))
            assert isinstance(new, PagedKVCache)
            return out, new, stats

        if stack is None:
            layer_stats = []
            for i, layer in enumerate(self.layers):
                x, flat, stats = run(layer, x, i, flat)
                layer_stats.append(stats)
            summary = _summary(layer_stats)
        else:

            def body(carry: tuple, xs: tuple) -> tuple[tuple, RouterStats | None]:
                (h, cache), (params, i) = carry, xs
                out, new, stats = run(stack.layer(params), h, i, cache)
                return (out, new), stats

            (x, flat), summary = jax.lax.scan(body, (x, flat), (stack.params, jnp.arange(num_layers, dtype=jnp.int32)))
        return x, jax.tree.map(lambda a: a.reshape(num_layers, blocks, *a.shape[1:]), flat), summary

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
        options: ForwardOptions = ForwardOptions(),
        valid: Bool[Array, "B T"] | None = None,
        lora: MultiLora | None = None,
    ) -> tuple[Float[Array, "B T V"], list | PagedKVCache | None, RouterStats | None]:
        """`hidden_states` through the LM head: logits, caches and router stats."""
        h, caches, stats = self.hidden_states(input_ids, positions, metadata, caches, layer_stack, options, valid, lora)
        return self.logits(h), caches, stats

    def __call__(
        self,
        input_ids: Int[Array, "B T"],
        segment_ids: Int[Array, "B T"] | None = None,
        positions: Int[Array, "B T"] | None = None,
        layer_stack: LayerStack | None = None,
        options: ForwardOptions = ForwardOptions(),
    ) -> Float[Array, "B T V"]:
        """Causal forward over whole rows (optionally packed: segment ids and per-document positions):
        logits only (`forward` also returns the router stats)."""
        if positions is None:
            positions = row_positions(input_ids)
        return self.forward(input_ids, positions, DenseMetadata(segment_ids=segment_ids), None, layer_stack, options)[0]

    def init_caches(self, batch: int, max_len: int, dtype: str | None = None) -> list[KVCache]:
        """Zeroed contiguous KV caches, one per layer."""
        cfg = self.cfg
        return [
            KVCache.zeros(batch, max_len, cfg.num_kv_heads, cfg.head_dim, jnp.dtype(dtype or cfg.dtype))
            for _ in range(cfg.num_layers)
        ]
