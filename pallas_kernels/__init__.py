"""Attention kernels, each beside its plain jax.numpy reference, behind one dispatcher."""

from pallas_kernels.attention_reference import attention_mask, mha_reference
from pallas_kernels.dispatch import (
    IMPLS,
    PAGED_IMPLS,
    attend,
    decode_attention,
    default_impl,
    dot_product_attention,
    paged_impl,
    ragged_attention,
)
from pallas_kernels.flash_attention import BlockSizes, flash_attention
from pallas_kernels.kv_quant import dequantize, quantize
from pallas_kernels.metadata import (
    BLOCK_SIZES,
    AttentionMetadata,
    ContiguousCacheMetadata,
    DenseMetadata,
    KVCache,
    PagedKVCache,
    PagedMetadata,
    kv_bytes_per_element,
    paged_head_dim,
)
from pallas_kernels.paged_tiles import TilePlan, tile_plan
from pallas_kernels.ragged_paged_attention import addressable_blocks

__all__ = [
    "BLOCK_SIZES",
    "IMPLS",
    "PAGED_IMPLS",
    "AttentionMetadata",
    "BlockSizes",
    "ContiguousCacheMetadata",
    "DenseMetadata",
    "KVCache",
    "PagedKVCache",
    "PagedMetadata",
    "TilePlan",
    "addressable_blocks",
    "attend",
    "attention_mask",
    "decode_attention",
    "default_impl",
    "dequantize",
    "dot_product_attention",
    "flash_attention",
    "kv_bytes_per_element",
    "mha_reference",
    "paged_head_dim",
    "paged_impl",
    "quantize",
    "ragged_attention",
    "tile_plan",
]
