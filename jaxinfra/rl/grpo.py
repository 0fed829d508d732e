"""GRPO (Shao et al. 2024, DeepSeekMath): rewards normalised within each prompt's group of samples
are the advantages; a PPO-style clipped surrogate plus a k3 KL estimate to a frozen reference model
is the loss. The math is plain functions; `GRPOLearner` holds the policy, reference and optimizer
state and runs one jitted update, its `params` ready for `LLM.update_weights`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxinfra.models.llama import merge_params

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """The update: Adam's learning rate and global-norm clip, the ratio clip range, the KL weight, and
    the sampling temperature (the policy whose log-probs are trained is softmax(logits / temperature))."""

    learning_rate: float = 1e-5
    grad_clip: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.04
    temperature: float = 1.0

    def __post_init__(self) -> None:
        for name in ("learning_rate", "grad_clip", "clip_eps", "temperature"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GRPOConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.kl_coef < 0:
            raise ValueError(f"GRPOConfig.kl_coef must be >= 0, got {self.kl_coef}")


def group_advantages(rewards: Float[np.ndarray, "G N"], eps: float = 1e-4) -> Float[np.ndarray, "G N"]:
    """(r - group mean) / (group std + eps) for each prompt's row of N samples (population std); a
    group whose rewards are all equal gets advantage 0 (it carries no signal)."""
    r = np.asarray(rewards, dtype=np.float32)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {r.shape}")
    centred = r - r.mean(axis=1, keepdims=True)
    return centred / (r.std(axis=1, keepdims=True) + eps)


def pack_rollouts(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], length: int, pad_id: int = 0
) -> tuple[Int[np.ndarray, "B L"], Float[np.ndarray, "B L-1"]]:
    """Rows prompt + completion, right-padded to `length` (a fixed length: one compiled update), and the
    mask over next-token positions that marks the completion's tokens (what the loss trains)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    tokens = np.full((len(prompts), length), pad_id, dtype=np.int32)
    mask = np.zeros((len(prompts), length - 1), dtype=np.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if not p:
            raise ValueError(f"prompts[{i}] is empty: the first completion token needs a context")
        if len(p) + len(c) > length:
            raise ValueError(f"row {i}: prompt + completion is {len(p) + len(c)} tokens, over length={length}")
        tokens[i, : len(p) + len(c)] = [*p, *c]
        mask[i, len(p) - 1 : len(p) - 1 + len(c)] = 1.0  # position t predicts token t + 1
    return tokens, mask


def token_logprobs(model: Any, tokens: Int[Array, "B L"], temperature: float = 1.0) -> Float[Array, "B L-1"]:
    """log p(tokens[:, t + 1] | tokens[:, :t + 1]) under `model` (called on int32 [B, L] ids, giving
    logits) at `temperature`."""
    logits = model(tokens).astype(jnp.float32) / temperature
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def grpo_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    ref_logp: Float[Array, "B T"],
    advantages: Float[Array, " B"],
    mask: Float[Array, "B T"],
    clip_eps: float,
    kl_coef: float,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """-(min(ratio * A, clip(ratio, 1 +- eps) * A) - kl_coef * KL) per completion token, averaged over
    each completion's tokens, then over completions. ratio = pi / pi_old; KL is the k3 estimate
    pi_ref / pi - log(pi_ref / pi) - 1 (unbiased, never negative). Also the mean KL and the clipped fraction."""
    ratio = jnp.exp(logp - old_logp)
    a = advantages[:, None]
    surrogate = jnp.minimum(ratio * a, jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * a)
    log_ref_ratio = ref_logp - logp
    kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0
    per_token = -(surrogate - kl_coef * kl)
    counts = jnp.maximum(mask.sum(axis=1), 1.0)

    def mean(x: jax.Array) -> jax.Array:
        return ((x * mask).sum(axis=1) / counts).mean()

    clipped = (jnp.abs(ratio - 1.0) > clip_eps).astype(jnp.float32)
    return mean(per_token), {"kl": mean(kl), "clip_fraction": mean(clipped)}


class GRPOLearner:
    """The policy's float32 params (a pure dict, what `LLM.update_weights` takes), a frozen copy as the
    reference, and Adam's state; `logprobs` for the rollouts' old and reference log-probs, `update` for
    one optimizer step on a batch."""

    def __init__(self, model: nnx.Module, cfg: GRPOConfig) -> None:
        self.cfg = cfg
        self.graphdef, state = nnx.split(model, nnx.Param)
        self.template = list(nnx.to_flat_state(state))
        self.params: Params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), nnx.to_pure_dict(state))
        self.reference: Params = jax.tree.map(jnp.copy, self.params)  # its own buffers: updates donate params'
        self.optimizer = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), optax.adam(cfg.learning_rate))
        self.opt_state = self.optimizer.init(self.params)
        self._logprobs = jax.jit(self._forward)
        self._update = jax.jit(self._step, donate_argnums=(0, 1))

    def _forward(self, params: Params, tokens: jax.Array) -> jax.Array:
        return token_logprobs(merge_params(self.graphdef, self.template, params), tokens, self.cfg.temperature)

    def _step(
        self, params: Params, opt_state: Any, reference: Params, batch: dict[str, jax.Array]
    ) -> tuple[Params, Any, dict[str, jax.Array]]:
        ref_logp = self._forward(reference, batch["tokens"])

        def loss_fn(p: Params) -> tuple[jax.Array, dict[str, jax.Array]]:
            logp = self._forward(p, batch["tokens"])
            return grpo_loss(
                logp,
                batch["old_logp"],
                ref_logp,
                batch["advantages"],
                batch["mask"],
                self.cfg.clip_eps,
                self.cfg.kl_coef,
            )

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, **metrics}

    def model(self) -> Any:
        """The current policy as a model (to export, or to evaluate outside the learner)."""
        return merge_params(self.graphdef, self.template, self.params)

    def logprobs(self, tokens: Int[np.ndarray, "B L"]) -> Float[np.ndarray, "B L-1"]:
        """Next-token log-probs of `tokens` under the current policy (the rollouts' pi_old)."""
        return np.asarray(self._logprobs(self.params, jnp.asarray(tokens)))

    def update(
        self,
        tokens: Int[np.ndarray, "B L"],
        mask: Float[np.ndarray, "B L-1"],
        advantages: Float[np.ndarray, " B"],
        old_logp: Float[np.ndarray, "B L-1"],
    ) -> dict[str, float]:
        """One Adam step on the GRPO loss of a batch (from `pack_rollouts`, one advantage per row, the
        rows' log-probs when sampled); returns the loss, mean KL to the reference and clipped fraction."""
        if not tokens.shape[0] == mask.shape[0] == advantages.shape[0] == old_logp.shape[0]:
            raise ValueError(
                f"batch rows differ: tokens {tokens.shape}, mask {mask.shape}, advantages {advantages.shape}, "
                f"old_logp {old_logp.shape}"
            )
        batch = {
            "tokens": jnp.asarray(tokens, jnp.int32),
            "mask": jnp.asarray(mask, jnp.float32),
            "advantages": jnp.asarray(advantages, jnp.float32),
            "old_logp": jnp.asarray(old_logp, jnp.float32),
        }
        self.params, self.opt_state, metrics = self._update(self.params, self.opt_state, self.reference, batch)
        return {k: float(v) for k, v in metrics.items()}
