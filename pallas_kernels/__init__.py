"""Attention kernels, each beside its plain jax.numpy reference, behind one dispatcher."""

from pallas_kernels.attention_reference import attention_mask, mha_reference
from pallas_kernels.dispatch import (IMPLS, attend, default_impl, dot_product_attention, paged_attention,
                                     ragged_paged_attention)
from pallas_kernels.flash_attention import BlockSizes, flash_attention
from pallas_kernels.kv_quant import dequantize, quantize
from pallas_kernels.metadata import (AttentionMetadata, ContiguousCacheMetadata, DenseMetadata, KVCache,
                                     PagedKVCache, PagedMetadata)

__all__ = [
    "IMPLS", "AttentionMetadata", "BlockSizes", "ContiguousCacheMetadata", "DenseMetadata", "KVCache",
    "PagedKVCache", "PagedMetadata", "attend", "attention_mask", "default_impl", "dequantize",
    "dot_product_attention", "flash_attention", "mha_reference", "paged_attention", "quantize",
    "ragged_paged_attention",
]
