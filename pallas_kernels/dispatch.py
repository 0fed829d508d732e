"""One entry point for attention: picks the implementation and routes on the metadata type."""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import cpu_paged_attention
from pallas_kernels.attention_reference import mha_reference
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.metadata import (
    AttentionMetadata,
    ContiguousCacheMetadata,
    DenseMetadata,
    KVCache,
    PagedKVCache,
    PagedMetadata,
)
from pallas_kernels.paged_attention import default_num_splits
from pallas_kernels.paged_attention import paged_attention as paged_attention_pallas
from pallas_kernels.paged_attention_reference import paged_attention_reference, ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention as ragged_paged_attention_pallas
from pallas_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla

Impl = Literal["pallas", "mosaic", "reference", "xla", "cudnn"]
IMPLS: tuple[str, ...] = ("pallas", "mosaic", "reference", "xla", "cudnn")


def default_impl() -> str:
    """Our Pallas kernels on GPU; the jnp reference elsewhere (Pallas runs interpreted off GPU)."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def _check_impl(impl: str | None) -> str:
    impl = default_impl() if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    return impl


def _jax_nn_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    implementation: Literal["xla", "cudnn"],
    causal: bool,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
    sliding_window: int | None,
    logit_softcap: float | None,
    scale: float | None,
) -> jax.Array:
    """jax.nn.dot_product_attention (XLA or cuDNN), a baseline for our kernels."""
    if logit_softcap is not None:
        raise ValueError(f"impl={implementation!r} does not support logit_softcap")
    mask = None
    if q_segment_ids is not None and kv_segment_ids is not None:
        if implementation == "cudnn":
            raise ValueError("impl='cudnn' does not support segment_ids")
        mask = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]
    if q.shape[1] != k.shape[1] and causal:
        raise ValueError(f"impl={implementation!r} needs T == S for causal attention")
    window = None if sliding_window is None else (sliding_window - 1, 0)
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=causal, local_window_size=window, implementation=implementation
    )


def _mosaic_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, scale: float | None, **features: Any
) -> jax.Array:
    """Our Mosaic GPU kernels (Hopper), forward and backward: plain causal or full attention. `features`:
    the dispatcher's other arguments (segment ids, window, soft-cap), which it refuses when given."""
    if names := [name for name, value in features.items() if value is not None]:
        raise ValueError(f"impl='mosaic' does not support {', '.join(names)}: use impl='pallas'")
    # imported when asked for: Mosaic GPU's modules take most of a second to import, and a serving
    # process on CPU (or a GPU run of the Triton kernels) never needs them
    from pallas_kernels.flash_attention_mgpu import flash_attention_mgpu

    return flash_attention_mgpu(q, k, v, causal=causal, scale=scale)


def dot_product_attention(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S KH D"],
    v: Float[Array, "B S KH D"],
    *,
    causal: bool = True,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    impl: str | None = None,
) -> Float[Array, "B T H D"]:
    """Dense attention (queries aligned to the end of the keys) by the chosen implementation."""
    impl = _check_impl(impl)
    kwargs: dict[str, Any] = dict(
        causal=causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        scale=scale,
    )
    if impl == "reference":
        return mha_reference(q, k, v, **kwargs)
    if impl == "pallas":
        return flash_attention(q, k, v, **kwargs)
    if impl == "mosaic":
        return _mosaic_attention(q, k, v, **kwargs)
    return _jax_nn_attention(q, k, v, implementation="cudnn" if impl == "cudnn" else "xla", **kwargs)


PAGED_IMPLS: tuple[str, ...] = ("pallas", "cpu", "xla", "reference")


def paged_impl(impl: str | None) -> str:
    """The paged-attention implementation `impl` names: by default our Pallas kernel on GPU, our C++
    kernel on CPU (the XLA formulation where it cannot be built), and the XLA formulation elsewhere
    (the jnp reference gathers whole tables and is kept as the oracle)."""
    if impl is None:
        if jax.default_backend() == "gpu":
            return "pallas"
        return "cpu" if jax.default_backend() == "cpu" and cpu_paged_attention.available() else "xla"
    if impl not in PAGED_IMPLS:
        raise ValueError(f"paged attention impl must be one of {PAGED_IMPLS}, got {impl!r}")
    if impl == "cpu" and jax.default_backend() != "cpu":
        raise ValueError(f"paged attention impl 'cpu' runs on CPU only, not on {jax.default_backend()}")
    return impl


def _paged_kwargs(
    cache: PagedKVCache, sliding_window: int | None, logit_softcap: float | None, scale: float | None
) -> dict[str, Any]:
    """Keyword arguments every paged kernel takes: the pools' scales and the attention variant."""
    return dict(
        k_scales=cache.k_scale,
        v_scales=cache.v_scale,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        scale=scale,
    )


def ragged_attention(
    q: Float[Array, "N H D"],
    cache: PagedKVCache,
    metadata: PagedMetadata,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    impl: str | None = None,
) -> Float[Array, "N H D"]:
    """Mixed prefill/decode attention of a flat token batch over the paged cache."""
    impl = paged_impl(impl)
    kwargs = _paged_kwargs(cache, sliding_window, logit_softcap, scale)
    kwargs["max_q_len"] = metadata.max_q_len
    args = (q, cache.k, cache.v, metadata.block_tables, metadata.cu_q_lens, metadata.kv_lens)
    if impl == "cpu" and cpu_paged_attention.reads(cache.k.dtype):
        return cpu_paged_attention.ragged_paged_attention_cpu(
            *args, sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale
        )
    if impl in ("xla", "cpu"):
        return ragged_paged_attention_xla(*args, plan=metadata.plan, **kwargs)
    if impl == "pallas":
        if metadata.max_q_len == 1:  # decode: split long contexts so few sequences still fill the device
            s, mb = metadata.block_tables.shape
            kwargs["num_splits"] = default_num_splits(s, mb, cache.k.shape[1])
        return ragged_paged_attention_pallas(*args, work=metadata.work, **kwargs)
    return ragged_paged_attention_reference(*args, **kwargs)


def decode_attention(
    q: Float[Array, "S H D"],
    cache: PagedKVCache,
    block_tables: Int[Array, "S MB"],
    context_lens: Int[Array, " S"],
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    impl: str | None = None,
) -> Float[Array, "S H D"]:
    """Decode attention: one new query per sequence over its pages."""
    impl = paged_impl(impl)
    kwargs = _paged_kwargs(cache, sliding_window, logit_softcap, scale)
    if impl == "pallas":
        return paged_attention_pallas(q, cache.k, cache.v, block_tables, context_lens, **kwargs)
    if impl == "reference":
        return paged_attention_reference(q, cache.k, cache.v, block_tables, context_lens, **kwargs)
    cu = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    if impl == "cpu" and cpu_paged_attention.reads(cache.k.dtype):
        return cpu_paged_attention.ragged_paged_attention_cpu(
            q,
            cache.k,
            cache.v,
            block_tables,
            cu,
            context_lens,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            scale=scale,
        )
    return ragged_paged_attention_xla(q, cache.k, cache.v, block_tables, cu, context_lens, max_q_len=1, **kwargs)


def attend(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B T KH D"],
    v: Float[Array, "B T KH D"],
    metadata: AttentionMetadata,
    cache: KVCache | PagedKVCache | None = None,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    impl: str | None = None,
) -> tuple[Float[Array, "B T H D"], KVCache | PagedKVCache | None]:
    """The attention layer's single call: store new K/V where the metadata says, then attend."""
    common: dict[str, Any] = dict(sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale)
    if isinstance(metadata, DenseMetadata):
        seg = metadata.segment_ids
        out = dot_product_attention(
            q, k, v, causal=metadata.causal, q_segment_ids=seg, kv_segment_ids=seg, impl=impl, **common
        )
        return out, cache
    if isinstance(metadata, ContiguousCacheMetadata):
        if cache is None:
            raise ValueError("ContiguousCacheMetadata needs a KVCache")
        rows = jnp.arange(q.shape[0])[:, None]
        cache = KVCache(
            cache.k.at[rows, metadata.positions].set(k.astype(cache.k.dtype)),
            cache.v.at[rows, metadata.positions].set(v.astype(cache.v.dtype)),
        )
        b, s = cache.k.shape[:2]
        out = mha_reference(
            q,
            cache.k,
            cache.v,
            causal=True,
            q_positions=metadata.positions,
            kv_positions=jnp.broadcast_to(jnp.arange(s), (b, s)),
            **common,
        )
        return out, cache
    if isinstance(metadata, PagedMetadata):
        if not isinstance(cache, PagedKVCache):
            raise ValueError("PagedMetadata needs a PagedKVCache")
        b, t, h, d = q.shape
        # every new key is written (slot_mapping has one slot per key); the queries may be a slice of
        # the keys' tokens (context parallelism: metadata from `query_slice`)
        cache = cache.write(k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]), metadata.slot_mapping)
        out = ragged_attention(q.reshape(b * t, h, d), cache, metadata, impl=impl, **common)
        return out.reshape(b, t, h, d), cache
    raise TypeError(f"unsupported attention metadata {type(metadata).__name__}")
