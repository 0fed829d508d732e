"""The pooling runner: prompts' hidden states through the engine's own model and weights in padded,
bucketed batches (one dense causal prefill a batch, no KV blocks taken or kept), pooled on device."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from pallas_kernels.metadata import DenseMetadata
from serve.config import EngineArgs
from serve.core.layout import CoreLayout
from serve.core.pooling.config import PoolingSpec, engine_pooling_spec
from serve.core.runner import ModelRunner
from serve.core.runner.device_step import DeviceStep

MIN_LENGTH = 16  # the shortest padded length a batch compiles for


def bucket(n: int, least: int = 1) -> int:
    """The power of two at least `n` (and `least`): batches pad to few shapes, so few compilations."""
    return max(least, 1 << max(0, n - 1).bit_length())


def pool_hidden(h: jax.Array, lengths: jax.Array, pooling_type: str) -> jax.Array:
    """[B, T, E] hidden states -> [B, E]: the mean over each row's `lengths` tokens, its last token, or
    its first (CLS)."""
    if pooling_type == "CLS":
        return h[:, 0]
    if pooling_type == "LAST":
        return jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
    mask = (jnp.arange(h.shape[1])[None, :] < lengths[:, None]).astype(h.dtype)
    return jnp.einsum("bte,bt->be", h, mask) / jnp.maximum(lengths, 1)[:, None].astype(h.dtype)


def load_score_head(directory: Path) -> np.ndarray:
    """A *ForSequenceClassification checkpoint's `score.weight` [labels, hidden], float32."""
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), "np") as f:
            if "score.weight" in f.keys():  # noqa: SIM118 - safetensors handles are not dicts
                return np.asarray(f.get_tensor("score.weight"), np.float32)
    raise ValueError(f"{directory}: a sequence classifier without a score.weight tensor")


class PoolingRunner:
    """Pools prompts with the engine's weights (read at each call, so weight updates apply);
    `score` is the classifier head for the classify task."""

    def __init__(
        self,
        device: DeviceStep,
        weights: Callable[[], list],
        spec: PoolingSpec,
        token_budget: int,
        max_model_len: int,
        score: np.ndarray | None = None,
    ) -> None:
        if spec.task == "classify" and score is None:
            raise ValueError("the classify task needs a score head")
        self.device, self.weights, self.spec, self.score = device, weights, spec, score
        self.token_budget, self.max_model_len = token_budget, max_model_len
        self._step = jax.jit(functools.partial(self._pool, pooling_type=spec.pooler.pooling_type))

    def _pool(self, weights: list, ids: jax.Array, lengths: jax.Array, pooling_type: str) -> jax.Array:
        def run() -> jax.Array:
            model, stack = self.device._model(weights)
            positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
            h, _, _ = model.hidden_states(ids, positions, DenseMetadata(), None, stack)
            return pool_hidden(h.astype(jnp.float32), lengths, pooling_type)

        return self.device._sharded(run)

    def pool(self, prompts: list[list[int]]) -> np.ndarray:
        """Each prompt's pooled hidden state [N, E] float32, batched by length under the token budget."""
        out: list[np.ndarray | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        start = 0
        while start < len(order):
            width = bucket(len(prompts[order[start]]), MIN_LENGTH)
            end = start + 1
            while end < len(order) and bucket(len(prompts[order[end]]), MIN_LENGTH) * bucket(end - start + 1) <= max(
                self.token_budget, width
            ):
                width = bucket(len(prompts[order[end]]), MIN_LENGTH)
                end += 1
            rows = order[start:end]
            ids = np.zeros((bucket(len(rows)), width), np.int32)
            lengths = np.ones((ids.shape[0],), np.int32)
            for r, i in enumerate(rows):
                ids[r, : len(prompts[i])] = prompts[i]
                lengths[r] = len(prompts[i])
            pooled = np.asarray(self._step(self.weights(), ids, lengths))
            for r, i in enumerate(rows):
                out[i] = pooled[r]
            start = end
        return np.stack([o for o in out if o is not None]) if prompts else np.zeros((0, 0), np.float32)

    def run(self, prompts: list[list[int]]) -> list[list[float]]:
        """The task's raw outputs: pooled vectors (embed; normalized by the caller, after any
        Matryoshka cut) or the classifier's logits (classify)."""
        if any(not p for p in prompts):
            raise ValueError("a pooling prompt needs at least one token")
        if longest := max((len(p) for p in prompts if len(p) > self.max_model_len), default=0):
            raise ValueError(f"a pooling prompt of {longest} tokens passes max_model_len ({self.max_model_len})")
        pooled = self.pool(prompts)
        if self.spec.task == "classify":
            assert self.score is not None
            pooled = pooled @ self.score.T
        return pooled.tolist()


def build_pooler(args: EngineArgs, runner: ModelRunner, layout: CoreLayout) -> PoolingRunner:
    """The engine core's pooling runner for --runner pooling: the task and pooler from the checkpoint
    and --convert / --pooler-config, over the core's model runner's weights."""
    spec, directory = engine_pooling_spec(args.model, args.convert, args.pooler_config)
    score = load_score_head(directory) if spec.task == "classify" and directory is not None else None
    budget, longest = layout.max_num_batched_tokens, layout.max_model_len
    return PoolingRunner(runner.device, lambda: runner.weights, spec, budget, longest, score)
