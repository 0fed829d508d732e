"""Attention kernels, each beside its plain jax.numpy reference, behind one dispatcher; multi-LoRA's
BGMV / SGMV kernels behind lora_apply."""

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
from pallas_kernels.lora import LORA_IMPLS, lora_apply, lora_impl
from pallas_kernels.lora_bgmv import BgmvTiles, bgmv_pallas
from pallas_kernels.lora_reference import NO_ADAPTER, lora_delta_reference, segment_slots
from pallas_kernels.lora_sgmv import SgmvTiles, sgmv_pallas
from pallas_kernels.lora_xla import lora_delta_xla
from pallas_kernels.metadata import (
    BLOCK_SIZES,
    AttentionMetadata,
    ContiguousCacheMetadata,
    DenseMetadata,
    KVCache,
    PagedKVCache,
    PagedMetadata,
    kv_bytes_per_element,
)
from pallas_kernels.paged_tiles import TilePlan, tile_plan
from pallas_kernels.ragged_paged_attention import addressable_blocks

__all__ = [
    "BLOCK_SIZES",
    "IMPLS",
    "LORA_IMPLS",
    "NO_ADAPTER",
    "PAGED_IMPLS",
    "AttentionMetadata",
    "BgmvTiles",
    "BlockSizes",
    "ContiguousCacheMetadata",
    "DenseMetadata",
    "KVCache",
    "PagedKVCache",
    "PagedMetadata",
    "SgmvTiles",
    "TilePlan",
    "addressable_blocks",
    "attend",
    "attention_mask",
    "bgmv_pallas",
    "decode_attention",
    "default_impl",
    "dequantize",
    "dot_product_attention",
    "flash_attention",
    "kv_bytes_per_element",
    "lora_apply",
    "lora_delta_reference",
    "lora_delta_xla",
    "lora_impl",
    "mha_reference",
    "paged_impl",
    "quantize",
    "ragged_attention",
    "segment_slots",
    "sgmv_pallas",
    "tile_plan",
]
