"""The optimizer of the train step: AdamW with warmup + cosine decay and global-norm clipping."""

from __future__ import annotations

import dataclasses

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup + cosine decay and global-norm clipping."""

    learning_rate: float = 3e-4
    warmup_steps: int = 100
    total_steps: int = 10_000
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Linear warmup from 0 to learning_rate, then cosine decay to 0 at total_steps."""
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, max(cfg.warmup_steps, 1), max(cfg.total_steps, cfg.warmup_steps + 1)
    )


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """AdamW with the schedule above and global-norm clipping; no decay on vectors (norms, biases)."""
    schedule = make_schedule(cfg)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask),
    )
