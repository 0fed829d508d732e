"""The draft_model proposer: a smaller model sharing the target's tokenizer proposes k greedy tokens a
row on device, right before the target verifies them.

The draft's KV pool has the target's block count and block size and is written through the target's
block tables and slot mappings, with the same tokens at the same positions: the draft runs every
step's flat batch too (prompt chunks, plain decodes), and in a verify step feeds each of its k
drafts at the position where the target then writes it. So the draft's pool mirrors the target's:
its blocks are the request's (allocated up front, freed with it, shared by prefix caching,
recomputed after preemption, rolled back with the target's), and the draft never has to catch up.
Greedy drafts are a deterministic function of the context, so the rejection sampler treats them as
n-gram drafts (one-hot proposal distribution) and the output stays distributed as the target's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfra.sampling import argmax
from pallas_kernels import PagedKVCache
from pallas_kernels.kv_quant import is_quantized_kv
from pallas_kernels.paged_tiles import kernel_work_list
from pallas_kernels.ragged_paged_attention import kernel_tile_tokens
from serve.config import kv_storage_dtype
from serve.core.host_transfer import unpack
from serve.core.runner.device_step import DeviceStep
from serve.core.runner.inputs import StepBatch, StepInputs
from serve.core.spec_decode.draft_rows import one_token_rows, row_slots


@dataclasses.dataclass(eq=False)  # hashable by identity: its bound methods are jitted
class DraftStep:
    """The draft's jitted work, as pure functions of (draft weights, draft KV pool, the target step's
    packed inputs): `mirror` for a plain step, `propose` for a verify step."""

    device: DeviceStep  # the draft model's structure and step constants
    kernel_shape: tuple[int, int, bool]  # Pallas: the draft's query heads per KV head, head dim, quantized KV

    def _own_tiles(self, inputs: StepInputs, max_q_len: int) -> StepInputs:
        """The Pallas work list sized for the draft's heads (the XLA tile plan is model-independent)."""
        if inputs.work is None:
            return inputs
        n = inputs.input_ids.shape[0]
        tokens = kernel_tile_tokens(*self.kernel_shape[:2], max_q_len, self.kernel_shape[2])
        return dataclasses.replace(inputs, work=kernel_work_list(inputs.cu_q_lens, n, tokens, jnp))

    def mirror(self, weights, caches, buffers, prev_tokens, *, layout, max_q_len):
        """A plain step: the draft's KV written for the step's flat batch, as the target's is."""
        self.device._traced()
        inputs = self._own_tiles(unpack(buffers, layout)[0], max_q_len)
        _, _, caches, _ = self.device._hidden(weights, caches, inputs, prev_tokens, max_q_len)
        return caches

    def propose(self, weights, caches, buffers, prev_tokens, *, layout, max_q_len):
        """A verify step (drafts and logit indices packed after the inputs as for the target): the
        draft runs the flat batch (its draft positions hold stand-ins, rewritten below), then k greedy
        decode steps from each row's last known token, each feeding the token it proposed at the
        next position. Returns the drafts [S, k] (-1 where the scheduler gave no room) and the pool."""
        self.device._traced()
        inputs, _, planned, indices = unpack(buffers, layout)
        inputs = self._own_tiles(inputs, max_q_len)
        return self._propose(weights, caches, inputs, planned, indices, prev_tokens, max_q_len)

    def _propose(self, weights, caches, inputs, planned, indices, prev_tokens, max_q_len):
        d = self.device
        model, h, caches, _ = d._hidden(weights, caches, inputs, prev_tokens, max_q_len)
        _, stack = d._model(weights)
        s, k = planned.shape
        num_drafts = (planned >= 0).sum(axis=1)
        first = indices[:, 0]  # each row's last known token in the flat batch
        pos0, kv0 = inputs.positions[first], inputs.kv_lens - num_drafts
        # one query token a row; the plan's pages reach the last position any row writes
        decode_inputs = one_token_rows(inputs, kv0 + num_drafts, d.block_size)
        token = argmax(model.logits(h[first]))

        def body(j, carry):
            token, drafts, caches = carry
            drafts = drafts.at[:, j - 1].set(token)
            active = j <= num_drafts  # positions the target writes this step
            pos = pos0 + j
            slots = row_slots(inputs.block_tables, pos, active, d.block_size)
            meta = d._meta(decode_inputs, jnp.where(active, kv0 + j, 0), slots, 1, jnp.where(active, pos, -1))
            hj, caches, _ = model.hidden_states(token[None], pos[None], meta, caches, stack)
            nxt = argmax(model.logits(hj[0]))
            return nxt, drafts, caches

        drafts = jnp.full((s, k), -1, jnp.int32)
        _, drafts, caches = jax.lax.fori_loop(1, k + 1, body, (token, drafts, caches))
        return jnp.where(planned >= 0, drafts, -1), caches


class DraftModelRunner:
    """The draft model placed beside the target: its weights, its KV pool (the target's block count
    and block size, its own layers and heads) and its jitted steps, dispatched before each of the
    target's with the same packed inputs (a DeviceProposer)."""

    # a verify step's rows are padded to at least this: the proposal loop over a single row hits an XLA
    # CPU slow path (measured 50 ms against 1.1 ms for two rows, default-draft, k = 3)
    verify_min_rows = 2

    def __init__(
        self,
        target: DeviceStep,
        device: DeviceStep,
        weights: list,
        *,
        num_blocks: int,
        kv_cache_dtype: str,
    ) -> None:
        """`device`, `weights`: the draft model's step closure and flat weights, as the target's runner
        makes its own."""
        self.target, self.device, self.weights = target, device, weights
        cfg = device.cfg
        self.kv_cache = PagedKVCache.zeros(
            num_blocks,
            target.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_storage_dtype(kv_cache_dtype, cfg.dtype),
            num_layers=cfg.num_layers,
        )
        pool = self.kv_cache.k
        kernel_shape = (cfg.num_heads // cfg.num_kv_heads, pool.shape[-1], is_quantized_kv(pool.dtype))
        self.step = DraftStep(self.device, kernel_shape)
        self._mirror = jax.jit(self.step.mirror, donate_argnums=(1,), static_argnames=("layout", "max_q_len"))
        # it proposes and the target verifies in one call (one dispatch a step)
        self._verify = jax.jit(
            self._propose_then_verify, donate_argnums=(1, 3), static_argnames=("layout", "max_q_len")
        )

    @property
    def num_compilations(self) -> int:
        """The draft's step shapes compiled so far."""
        return self.device.num_compilations

    def mirror(self, buffers: Any, layout: Any, prev_tokens: jax.Array, max_q_len: int) -> None:
        """A plain step's KV (packed inputs and sampling, as the target's step gets them)."""
        self.kv_cache = self._mirror(
            self.weights, self.kv_cache, buffers, prev_tokens, layout=layout, max_q_len=max_q_len
        )

    def before_step(self, batch: StepBatch, buffers: Any, layout: Any, prev_tokens: jax.Array) -> Any:
        """A plain step while speculation is on: the draft's pool mirrors the target's (a verify step's
        drafts are made inside its call)."""
        if batch.spec is not None or not batch.sched.may_draft:
            return buffers
        buffers = jax.device_put(buffers)  # sent once, read by both models
        self.mirror(buffers, layout, prev_tokens, batch.max_q_len)
        return buffers

    def verify(
        self, verify: Any, weights: list, kv_cache: Any, buffers: Any, prev_tokens: jax.Array, **static: Any
    ) -> tuple:
        """The draft's drafts and the target's verify step over them, in one call (`verify` unused)."""
        verified, self.kv_cache = self._verify(
            weights, kv_cache, self.weights, self.kv_cache, buffers, prev_tokens, **static
        )
        return verified

    def after_step(self, *_: Any) -> None:
        """Nothing: the draft has run before the target."""

    def _propose_then_verify(
        self, weights, kv_cache, draft_weights, draft_kv, buffers, prev_tokens, *, layout, max_q_len
    ):
        """The draft's drafts (DraftStep.propose), then the target's verify step over them; returns
        the verify step's outputs and the draft's pool."""
        drafts, draft_kv = self.step.propose(
            draft_weights, draft_kv, buffers, prev_tokens, layout=layout, max_q_len=max_q_len
        )
        verified = self.target.verify(
            weights, kv_cache, buffers, prev_tokens, drafts, layout=layout, max_q_len=max_q_len
        )
        return verified, draft_kv
