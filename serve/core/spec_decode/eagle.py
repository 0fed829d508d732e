"""The EAGLE proposer: a head (jaxinfra.models.eagle) over the target's hidden states drafts k greedy
tokens a row on device right after each target step; the next step verifies them.

After the target's step the head runs over the step's flat batch (each position's target feature
and the token that follows it: the next in the batch, the token just sampled, or the next prompt
token of an unfinished prompt chunk), writing its own one-layer KV pool through the target's block
tables. Then, from each sampling row's last accepted position, it decodes k tokens, feeding back its
own predicted features. Those k positions are written ahead of the row's tokens (the scheduler
allocates `lookahead` = k slots past each step for them); the next step's flat pass rewrites them
with the target's features. The drafts come back with the step's results and the scheduler hands
them to the next step as n-gram drafts are (greedy: a one-hot proposal, so outputs keep the target's
distribution). With speculation auto-off (too many running) the head is skipped, and the sequences of
such steps draft no more (draft_slots.note_gaps): their head caches have a gap.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfra.models.eagle import EagleHead
from jaxinfra.sampling import argmax
from pallas_kernels import PagedKVCache
from serve.config import kv_storage_dtype
from serve.core.host_transfer import unpack
from serve.core.runner.device_step import DeviceStep
from serve.core.runner.inflight import InFlight
from serve.core.runner.inputs import StepBatch
from serve.core.spec_decode.draft_rows import one_token_rows, row_slots
from serve.core.step_data import SchedulerOutput


@dataclasses.dataclass(eq=False)  # hashable by identity: its bound method is jitted
class EagleStep:
    """The head's jitted work as a pure function of (target weights, head weights, head KV pool, the
    target step's hidden states, packed inputs and sampled tokens)."""

    target: DeviceStep
    head_def: nnx.GraphDef
    k: int

    def propose(
        self,
        target_weights,
        head_params,
        pool,
        h,
        buffers,
        prev_tokens,
        last,
        num_emitted,
        rows,
        *,
        layout,
        max_q_len,
    ):
        """Drafts [S, k] (-1 for rows that did not sample) and the head's pool. `rows` [2, S]: each
        row's next prompt token if its prompt goes on (-1: it sampled) and its slot limit."""
        self.target._traced()
        inputs, _, *spec = unpack(buffers, layout)
        model, _ = self.target._model(target_weights)  # embedding and LM head (the layers go unused)
        head: EagleHead = nnx.merge(self.head_def, head_params)
        s, bs = inputs.kv_lens.shape[0], self.target.block_size
        next_prompt, limit = rows[0], rows[1]
        counts = inputs.cu_q_lens[1:] - inputs.cu_q_lens[:-1]
        row_next = jnp.where(next_prompt >= 0, next_prompt, last[:s])
        ids = self.target._input_ids(inputs, prev_tokens)
        t = ids.shape[0]
        # the token after each flat position: the next one in the batch, or the row's next token
        nxt = jnp.roll(ids, -1).at[jnp.where(counts > 0, inputs.cu_q_lens[1:] - 1, t)].set(row_next, mode="drop")
        meta = self.target._meta(inputs, inputs.kv_lens, inputs.slot_mapping, max_q_len)
        _, pool = head(model.embed_tokens(nxt[None]), h[None], inputs.positions[None], meta, pool)
        if spec:  # a verify step: each row's last accepted token
            last_index = jnp.take_along_axis(spec[1], (jnp.maximum(num_emitted, 1) - 1)[:, None], axis=1)[:, 0]
        else:
            last_index = inputs.logits_indices
        active0 = (counts > 0) & (next_prompt < 0)
        pos0 = inputs.positions[last_index]
        decode_inputs = one_token_rows(inputs, jnp.minimum(pos0 + self.k, limit), bs)

        def body(j, carry):
            token, feature, drafts, pool = carry
            pos = pos0 + j
            active = active0 & (pos < limit)
            slots = row_slots(inputs.block_tables, pos, active, bs)
            meta = self.target._meta(decode_inputs, jnp.where(active, pos + 1, 0), slots, 1, jnp.where(active, pos, -1))
            out, pool = head(model.embed_tokens(token[None, :]), feature[None], pos[None], meta, pool)
            token = argmax(model.logits(out[0]))
            return token, out[0], drafts.at[:, j].set(jnp.where(active, token, -1)), pool

        init = (row_next, h[last_index], jnp.full((s, self.k), -1, jnp.int32), pool)
        return jax.lax.fori_loop(0, self.k, body, init)[2:]


class EagleRunner:
    """The head placed beside the target: its weights, its one-layer KV pool (the target's block count
    and block size) and its jitted step, called after each of the target's steps (a DeviceProposer)."""

    verify_min_rows = 1  # a verify step's rows: no padding beyond the target's
    num_compilations = 0  # its traces count as the target's (EagleStep.propose)

    def __init__(
        self,
        target: DeviceStep,
        head: EagleHead,
        k: int,
        *,
        num_blocks: int,
        kv_cache_dtype: str,
        max_len: int,
    ) -> None:
        """`max_len`: the engine's max_model_len (no KV slot past it)."""
        cfg = head.cfg
        self.head_def, self.params = nnx.split(head)
        self.k, self.max_len = k, max_len
        self.kv_cache = PagedKVCache.zeros(
            num_blocks,
            target.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_storage_dtype(kv_cache_dtype, cfg.dtype),
        )
        self.step = EagleStep(target, self.head_def, k)
        self._propose = jax.jit(self.step.propose, donate_argnums=(2,), static_argnames=("layout", "max_q_len"))

    def row_columns(self, sched: SchedulerOutput, sb: int) -> np.ndarray:
        """[2, sb]: each row's next prompt token where its prompt goes on (-1 where it samples) and how
        many of its positions have KV slots (the step's tokens and the scheduler's lookahead)."""
        n = len(sched.seqs)
        columns = np.zeros((2, sb), np.int32)
        columns[0] = -1
        end = sched.num_computed + sched.num_new
        columns[1, :n] = np.minimum(end + self.k, self.max_len)
        for i in np.flatnonzero(~sched.samples).tolist():
            columns[0, i] = sched.seqs[i].tokens[end[i]]
        return columns

    def before_step(self, batch: StepBatch, buffers: Any, layout: Any, prev_tokens: jax.Array) -> Any:
        """The step's packed inputs sent once, read by both the target and the head."""
        return jax.device_put(buffers) if batch.spec is not None or batch.sched.may_draft else buffers

    def verify(
        self, verify: Any, weights: list, kv_cache: Any, buffers: Any, prev_tokens: jax.Array, **static: Any
    ) -> tuple:
        """The target's verify step over the drafts the head made after the last step."""
        return verify(weights, kv_cache, buffers, prev_tokens, None, **static)

    def after_step(
        self,
        flight: InFlight,
        weights: list,
        hidden: list,
        buffers: Any,
        layout: Any,
        prev_tokens: jax.Array,
        last: jax.Array,
    ) -> None:
        """While speculation is on, the next step's drafts [S, k] on device from this step's hidden
        states (see EagleStep.propose), into `flight.drafts`."""
        batch = flight.batch
        if not batch.sched.may_draft:
            return
        flight.drafts, self.kv_cache = self._propose(
            weights,
            self.params,
            self.kv_cache,
            hidden[0],
            buffers,
            prev_tokens,
            last,
            flight.num_emitted,
            self.row_columns(batch.sched, batch.inputs.kv_lens.shape[0]),
            layout=layout,
            max_q_len=batch.max_q_len,
        )
