"""Reinforcement learning on the model: GRPO (group-relative policy optimisation) against a frozen reference."""

from jaxinfra.rl.grpo import (
    GRPOConfig,
    GRPOLearner,
    group_advantages,
    grpo_loss,
    pack_rollouts,
    token_logprobs,
)

__all__ = ["GRPOConfig", "GRPOLearner", "group_advantages", "grpo_loss", "pack_rollouts", "token_logprobs"]
