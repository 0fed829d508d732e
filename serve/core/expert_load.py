"""Per-expert load of a mixture-of-experts model being served: each device step counts the token
copies its MoE layers routed to each expert (on device, returned with the step's outputs); the
engine core sums them here, and the frontend shows them on /metrics and /status (the dashboard)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from jaxinfra.models.moe import imbalance


@dataclasses.dataclass
class ExpertLoadStats:
    """Cumulative token copies per MoE layer and expert ([layers][experts]: each layer's row sums to
    its tokens x top-k), steps counted, and the last step's imbalance (max / mean copies per expert,
    averaged over MoE layers; 1 = even)."""

    tokens: list[list[int]]
    steps: int = 0
    last_imbalance: float = 1.0

    def summary(self) -> dict[str, Any]:
        """What /status shows: copies per expert (all MoE layers), imbalance since start and last step."""
        counts = np.asarray(self.tokens)
        return {
            "steps": self.steps,
            "tokens_per_expert": counts.sum(axis=0).tolist(),
            "imbalance": float(imbalance(counts)) if counts.any() else 1.0,
            "last_step_imbalance": self.last_imbalance,
        }


class ExpertLoad:
    """The engine core's running sum of the steps' per-expert counts."""

    def __init__(self, layers: int, experts: int) -> None:
        self.tokens = np.zeros((layers, experts), np.int64)
        self.steps = 0
        self.last_imbalance = 1.0

    def observe(self, counts: np.ndarray) -> None:
        """One step's (or a decode loop's) copies per expert [MoE layers, experts]."""
        self.tokens += counts
        self.steps += 1
        self.last_imbalance = float(imbalance(counts)) if counts.any() else 1.0

    def stats(self) -> ExpertLoadStats:
        return ExpertLoadStats(self.tokens.tolist(), self.steps, self.last_imbalance)


class ExpertLoadMetrics:
    """moe_expert_tokens{layer, expert} (token copies each expert computed; layer: the MoE layer's
    index among the model's MoE layers) and
    moe_expert_load_imbalance (the last step's max / mean), fed the core's cumulative stats."""

    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str) -> None:
        self.model_name = model_name
        self.tokens = Counter(
            f"{prefix}:moe_expert_tokens",
            "Token copies routed to each expert of each MoE layer (a layer's sum: its tokens x top-k).",
            ["model_name", "layer", "expert"],
            registry=registry,
        )
        self.imbalance = Gauge(
            f"{prefix}:moe_expert_load_imbalance",
            "The last step's expert load imbalance: max / mean token copies per expert, averaged over MoE layers.",
            ["model_name"],
            registry=registry,
        ).labels(model_name)
        self._seen: np.ndarray | None = None

    def observe(self, stats: ExpertLoadStats) -> None:
        """Add what the core counted since the last call (a restarted core counts from zero again)."""
        now = np.asarray(stats.tokens, np.int64)
        seen = self._seen
        if seen is None or seen.shape != now.shape:  # every series shows, at zero until its expert is used
            for layer, expert in np.ndindex(now.shape):
                self.tokens.labels(self.model_name, str(layer), str(expert))
        if seen is None or seen.shape != now.shape or (now < seen).any():
            seen = np.zeros_like(now)
        for layer, expert in zip(*np.nonzero(now - seen)):
            self.tokens.labels(self.model_name, str(layer), str(expert)).inc(
                int(now[layer, expert] - seen[layer, expert])
            )
        self.imbalance.set(stats.last_imbalance)
        self._seen = now
