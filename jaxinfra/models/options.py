"""The forward pass's settings, passed explicitly to the model: which kernels and layouts it uses,
what it recomputes, and what it reports besides its outputs (nothing here changes the weights)."""

from __future__ import annotations

import dataclasses

import jax

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.checkpoint_dots,
}


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """One forward pass's options; the defaults are serving's plain forward."""

    # dense Q/K/V and gate/up projections as one matmul each (weights joined at trace time): for
    # training, where the join is cheap next to the step; decoding would read the weights twice
    fused_projections: bool = False
    # MoE: each expert takes at most ceil(factor * token copies / experts) copies; the rest are dropped
    # (their residual passes through). None: dropless
    capacity_factor: float | None = None
    router_stats: bool = False  # MoE: hidden_states / forward also return the router's RouterStats
    zigzag: bool = False  # rows split over the context axis arrive in `zigzag_order` (the caller reordered them)
    remat: str = "none"  # recompute each decoder layer in the backward pass: a REMAT_POLICIES key
    compute_dtype: str | None = None  # activations' dtype when the weights are float32 masters
    # LoRA adapters with dropout > 0 drop their inputs, randomly from this key (training steps); None: none do
    dropout_key: jax.Array | None = None

    def __post_init__(self) -> None:
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {self.capacity_factor}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"ForwardOptions.remat must be one of {tuple(REMAT_POLICIES)}, got {self.remat!r}")
