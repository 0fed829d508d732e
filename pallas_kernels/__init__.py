"""Attention kernels, each beside its plain jax.numpy reference, behind one dispatcher."""

from pallas_kernels.attention_reference import attention_mask, mha_reference
from pallas_kernels.flash_attention import BlockSizes, flash_attention
from pallas_kernels.dispatch import IMPLS, attend, default_impl, dot_product_attention
from pallas_kernels.metadata import AttentionMetadata, ContiguousCacheMetadata, DenseMetadata, KVCache

__all__ = [
    "BlockSizes", "IMPLS", "AttentionMetadata", "ContiguousCacheMetadata", "DenseMetadata", "KVCache",
    "attend", "attention_mask", "default_impl", "dot_product_attention", "flash_attention",
    "mha_reference",
]
