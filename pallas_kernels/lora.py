"""Multi-LoRA's one entry point: each token's adapter delta, by BGMV (per-token slots, decode) or
SGMV (segments sharing a slot, prefill), picking Pallas on GPU and XLA elsewhere.

Pools and slots are described in lora_reference.py: A [S, in, R], B [S, R, out], scaling [S],
slot -1 for "no adapter", smaller ranks zero-padded to R. The caller adds the delta to the base
projection's output.
"""

from __future__ import annotations

import jax
from jaxtyping import Array, Float, Int

from pallas_kernels.lora_bgmv import bgmv_pallas
from pallas_kernels.lora_reference import check_segments, lora_delta_reference, segment_slots
from pallas_kernels.lora_sgmv import sgmv_pallas
from pallas_kernels.lora_xla import lora_delta_xla

LORA_IMPLS: tuple[str, ...] = ("pallas", "xla", "reference")


def lora_impl(impl: str | None) -> str:
    """The implementation `impl` names; by default our Pallas kernels on GPU, XLA elsewhere (Pallas
    runs interpreted off GPU)."""
    if impl is None:
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if impl not in LORA_IMPLS:
        raise ValueError(f"lora impl must be one of {LORA_IMPLS}, got {impl!r}")
    return impl


def lora_apply(
    x: Float[Array, "T IN"],
    a: Float[Array, "S IN R"],
    b: Float[Array, "S R OUT"],
    scaling: Float[Array, " S"],
    *,
    slots: Int[Array, " T"] | None = None,
    seg_starts: Int[Array, " G1"] | None = None,
    seg_slots: Int[Array, " G"] | None = None,
    impl: str | None = None,
) -> Float[Array, "T OUT"]:
    """scaling[s] * (x[t] @ A[s]) @ B[s] per token, in x's dtype. Give either `slots` (one per token,
    any order: BGMV) or `seg_starts` [G + 1] and `seg_slots` [G] (contiguous segments: SGMV)."""
    impl = lora_impl(impl)
    if slots is not None and seg_starts is None and seg_slots is None:
        if impl == "pallas":
            return bgmv_pallas(x, slots, a, b, scaling)
        per_token = slots
    elif slots is None and seg_starts is not None and seg_slots is not None:
        check_segments(seg_starts, seg_slots)
        if impl == "pallas":
            return sgmv_pallas(x, seg_starts, seg_slots, a, b, scaling)
        per_token = segment_slots(seg_starts, seg_slots, x.shape[0])
    else:
        raise ValueError("lora_apply needs either slots or both seg_starts and seg_slots")
    if impl == "xla":
        return lora_delta_xla(x, per_token, a, b, scaling)
    return lora_delta_reference(x, per_token, a, b, scaling)
