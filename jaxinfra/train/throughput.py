"""Model FLOPs per token (for MFU), known accelerator peaks, and per-device memory."""

from __future__ import annotations

import jax

from jaxinfra.config import ModelConfig

# bf16 dense peak TFLOP/s per device, matched against jax's device_kind.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 125.0}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM's accounting: 6 x matmul params (the embedding lookup is not a
    matmul; a tied embedding still is the LM head; a mixture of experts counts the top-k experts a
    token uses) + 12 x layers x attention width x sequence length."""
    return 6.0 * cfg.num_matmul_params + 12.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len


def device_peak_tflops() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_TFLOPS.items() if k in kind), None)


def device_memory_gib() -> dict[str, float]:
    """In-use and peak bytes of this process's first device (empty on backends without memory stats)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    names = {"mem_gib": "bytes_in_use", "mem_peak_gib": "peak_bytes_in_use"}
    return {name: stats[key] / 2**30 for name, key in names.items() if key in stats}
