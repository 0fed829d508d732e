"""LoRA's settings: `lora: {rank, alpha, dropout, target_modules}` of a `jaxinfra train` config."""

from __future__ import annotations

import dataclasses

# The projections an adapter can wrap: attention and (dense or shared-expert) MLP, by HF's names.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters W + (alpha / rank) * A @ B on `target_modules`; the base weights are frozen."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0  # on the adapter's input, in training only
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    use_rslora: bool = False  # PEFT's alpha / sqrt(rank) scaling: not supported

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise ValueError(f"lora.rank must be a positive int, got {self.rank!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty")
        unknown = sorted(set(self.target_modules) - set(TARGET_MODULES))
        if unknown:
            raise ValueError(f"lora.target_modules: unknown module(s) {unknown}; known: {list(TARGET_MODULES)}")
        if self.use_rslora:
            raise ValueError("lora.use_rslora: only alpha / rank scaling (use_rslora: false) is supported")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
