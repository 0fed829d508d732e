"""`jaxinfra train` with `eagle_target`: an EAGLE head trained on a frozen target's hidden states.

Each batch runs the target once (no gradients) for its final-norm hidden states f; the head, fed
[embed(x[t+1]); f[t]], is trained to predict f[t+1] (smooth L1, weight 1) and, through the target's
LM head, the target's next-token distribution there (soft cross-entropy, weight 0.1): EAGLE's
objective. Evaluation reports the head's top-1 agreement with the target, the acceptance rate of a
greedy first draft. One device; the recipe's mesh and sharding settings are not used.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxinfra.data import DataLoader
from jaxinfra.loading import load_model, load_tokenizer
from jaxinfra.models import LlamaModel
from jaxinfra.models.eagle import EagleHead, head_config, save_eagle_head
from jaxinfra.train.config import RunConfig, dump_run_config
from jaxinfra.train.logger import MetricsLogger, plot_losses
from jaxinfra.train.optimizer import make_optimizer
from jaxinfra.train.run_steps import RunData, run_steps
from pallas_kernels import DenseMetadata

FEATURE_WEIGHT, TOKEN_WEIGHT = 1.0, 0.1  # EAGLE's regression and classification loss weights


def eagle_losses(head: EagleHead, target: LlamaModel, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Summed feature loss, token loss and top-1 agreements over the batch's counted positions, and their count."""
    ids, positions, segments = batch["input_ids"], batch["positions"], batch.get("segment_ids")
    feats, _, _ = target.hidden_states(ids, positions, DenseMetadata(segment_ids=segments))
    feats = jax.lax.stop_gradient(feats)
    head_segments = None if segments is None else segments[:, :-1]
    out, _ = head(target.embed_tokens(ids[:, 1:]), feats[:, :-1], positions[:, :-1], DenseMetadata(head_segments))
    want = feats[:, 1:]
    target_logits = jax.lax.stop_gradient(target.logits(want))
    head_logits = target.logits(out)
    token = optax.softmax_cross_entropy(head_logits, jax.nn.softmax(target_logits, axis=-1))
    feature = optax.huber_loss(out.astype(jnp.float32), want.astype(jnp.float32)).mean(axis=-1)
    agree = jnp.argmax(head_logits, axis=-1) == jnp.argmax(target_logits, axis=-1)
    mask = batch["loss_mask"][:, :-1].astype(jnp.float32)  # x[t+1] follows x[t] in the same document
    return {
        "feature": jnp.sum(feature * mask),
        "token": jnp.sum(token * mask),
        "agree": jnp.sum(agree * mask),
        "count": jnp.sum(mask),
    }


def _objective(parts: dict[str, jax.Array]) -> jax.Array:
    return (FEATURE_WEIGHT * parts["feature"] + TOKEN_WEIGHT * parts["token"]) / jnp.maximum(parts["count"], 1.0)


class EagleTrainer:
    """The jitted train and eval steps of a head over a frozen target (both as split nnx states)."""

    def __init__(self, head: EagleHead, target: LlamaModel, optim: Any) -> None:
        self.head_def, self.params = nnx.split(head, nnx.Param)
        self.target_def, self.target_state = nnx.split(target)
        self.optimizer = make_optimizer(optim)
        self.opt_state = self.optimizer.init(self.params)
        self._train = jax.jit(self._train_impl, donate_argnums=(0, 1))
        self._eval = jax.jit(self._eval_impl)

    def _parts(self, params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        head = nnx.merge(self.head_def, params)
        return eagle_losses(head, nnx.merge(self.target_def, self.target_state), batch)

    def _train_impl(self, params: Any, opt_state: Any, batch: dict[str, jax.Array]):
        def loss(p: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
            parts = self._parts(p, batch)
            return _objective(parts), parts

        (value, parts), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": value, **parts}

    def _eval_impl(self, params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return self._parts(params, batch)

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """One optimizer step; the batch's summed loss parts (on device)."""
        self.params, self.opt_state, metrics = self._train(self.params, self.opt_state, batch)
        return metrics

    def evaluate(self, data: DataLoader, num_batches: int) -> dict[str, float]:
        """Objective, token loss (nats) and top-1 agreement with the target over the held-out batches."""
        data.restart()
        sums: dict[str, float] = {}
        for _, rows in zip(range(num_batches), data):
            for k, v in jax.device_get(self._eval(self.params, rows)).items():
                sums[k] = sums.get(k, 0.0) + float(v)
        if not sums.get("count"):
            raise ValueError("data: the held-out split packs into fewer rows than one batch")
        n = sums["count"]
        loss = (FEATURE_WEIGHT * sums["feature"] + TOKEN_WEIGHT * sums["token"]) / n
        return {"loss": loss, "token_loss": sums["token"] / n, "agreement": sums["agree"] / n}

    def head(self) -> EagleHead:
        return nnx.merge(self.head_def, self.params)


def train_eagle(cfg: RunConfig, progress: bool = True) -> tuple[Path, float | None, float]:
    """Train the head the recipe describes; returns (head directory, held-out loss, unigram entropy).
    The head is written to <out_dir>/hf with metrics.json (held-out agreement and losses)."""
    assert cfg.eagle_target is not None
    out = Path(cfg.out_dir)
    target = load_model(cfg.eagle_target, dtype="float32")
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.eagle_target)
    head = EagleHead(head_config(target.cfg).replace(dtype="float32"), nnx.Rngs(cfg.seed))
    data = RunData.open(cfg, tokenizer, cfg.batch_size)
    trainer = EagleTrainer(head, target, cfg.optim)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_run_config(cfg))
    logger = MetricsLogger(out, cfg.steps, 0, True, progress)

    def record(fetched: list[dict[str, Any]], _: int, __: float) -> dict[str, float]:
        count = sum(float(m["count"]) for m in fetched)
        agreement = sum(float(m["agree"]) for m in fetched) / max(count, 1.0)
        return {"loss": float(np.mean([m["loss"] for m in fetched])), "agreement": agreement}

    valid = data.valid
    evaluate = (lambda: trainer.evaluate(valid, cfg.eval_batches)) if valid is not None else None
    evaluation = run_steps(cfg, 0, logger, lambda _: trainer.step(next(data.train)), record, evaluate)
    logger.close()
    data.close()
    hf = out / "hf"
    save_eagle_head(trainer.head(), hf)
    metrics = {"steps": cfg.steps, "target": str(cfg.eagle_target), **{f"eval_{k}": v for k, v in evaluation.items()}}
    (hf / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    plot_losses(out / "metrics.jsonl", out / "loss.png")
    loss = evaluation.get("loss")
    return hf, None if loss is None or math.isnan(loss) else loss, data.entropy
