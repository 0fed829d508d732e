"""The jitted device steps, as pure functions of (weights, KV pools, packed inputs): forward and
sample, the speculative verify step, the resampler (penalties, logit_bias, grammar masks) and the
multi-step decode loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfra.config import ModelConfig
from jaxinfra.models import LlamaModel
from jaxinfra.models.llama import LayerStack, merge_params, unstack_layers
from jaxinfra.models.multi_lora import MultiLora
from jaxinfra.models.options import ForwardOptions
from pallas_kernels import PagedMetadata
from serve.core.host_transfer import unpack
from serve.core.runner.inputs import StepInputs
from serve.core.sampler import SamplerOutput, apply_bitmask, apply_penalties, sample
from serve.core.sequence import stop_code
from serve.core.spec_decode import rejection_sample
from serve.core.spec_decode.verify_batch import with_drafts
from serve.sampling_params import MAX_LOGPROBS
from sharding import logical_rules

if TYPE_CHECKING:  # serve.core.layout imports this package (its sizing)
    from serve.core.layout import CoreLayout

PROMPT_LOGPROB_CHUNK = 128  # prompt tokens whose full-vocabulary logprobs are computed at once
# called in each decode loop iteration with [step id, iteration, S tokens (-1: none), S stop codes];
# returns a receipt the loop carries to its outputs
LoopTap = Callable[[jax.Array], jax.Array]
COUNTED = ForwardOptions(router_stats=True)  # MoE models: the step also returns its expert load


@dataclasses.dataclass(eq=False)  # hashable by identity: its bound methods are jitted
class DeviceStep:
    """What the traced steps close over: the model's structure (its weights arrive as a flat list),
    the activation sharding rules, and the core's layout. `num_compilations` counts traces."""

    cfg: ModelConfig
    graphdef: nnx.GraphDef
    template: list
    layer_graph: tuple[nnx.GraphDef, list] | None  # identical layers: their weights arrive stacked
    state_def: Any  # the weights' pytree structure
    mesh: Any
    activation_rules: Any
    layout: CoreLayout  # block size, rows (max_num_seqs) and EOS ids
    loop_tap: LoopTap | None  # decode loops' (serve.core.loop_stream.device_tap), or None
    return_hidden: bool  # single and verify steps also return the flat batch's hidden states (EAGLE)
    lora_def: Any = None  # multi-LoRA: the adapter pools' pytree structure (they follow the weights)
    num_compilations: int = 0

    @property
    def block_size(self) -> int:
        """Tokens per KV block (the layout's)."""
        return self.layout.block_size

    def _traced(self) -> None:
        self.num_compilations += 1  # runs only while tracing: counts compilations

    def _model(self, weights: list) -> tuple[LlamaModel, LayerStack | None]:
        """The model (inside a jitted step) and, when its layers are stacked, the stack to scan."""
        params = jax.tree.unflatten(self.state_def, weights[: self.state_def.num_leaves])
        if self.layer_graph is None:
            return merge_params(self.graphdef, self.template, params), None
        # the per-layer slices serve the template only: the scan reads the stack, XLA drops the slices
        per_layer = unstack_layers(params, self.cfg.num_layers)
        return merge_params(self.graphdef, self.template, per_layer), LayerStack(*self.layer_graph, params["layers"])

    def _lora(self, weights: list, slots: jax.Array | None) -> MultiLora | None:
        """Multi-LoRA's adapter pools (the weights' tail) with each token's slot, or None (LoRA off)."""
        if self.lora_def is None or slots is None:
            return None
        return MultiLora.of(slots, jax.tree.unflatten(self.lora_def, weights[self.state_def.num_leaves :]))

    def _sharded(self, fn, *args, **kwargs):
        if self.mesh is None:
            return fn(*args, **kwargs)
        with logical_rules(self.mesh, self.activation_rules):
            return fn(*args, **kwargs)

    def _meta(
        self, inputs: StepInputs, kv_lens: jax.Array, slots: jax.Array, max_q_len: int, q_pos: jax.Array | None = None
    ) -> PagedMetadata:
        plan = inputs.plan
        if plan is not None and q_pos is not None:
            plan = dataclasses.replace(plan, q_pos=q_pos[:, None])
        return PagedMetadata(
            slots, inputs.block_tables, inputs.cu_q_lens, kv_lens, max_q_len, plan=plan, work=inputs.work
        )

    @staticmethod
    def _input_ids(inputs: StepInputs, prev_tokens: jax.Array) -> jax.Array:
        prev = inputs.prev_index
        return jnp.where(prev >= 0, prev_tokens[jnp.maximum(prev, 0)], inputs.input_ids)

    def _padded(self, tokens: jax.Array) -> jax.Array:
        return jnp.zeros((self.layout.max_num_seqs,), jnp.int32).at[: tokens.shape[0]].set(tokens)

    def _prompt_logprobs(self, model: LlamaModel, h: jax.Array, targets: jax.Array):
        """log p(next prompt token) and the top MAX_LOGPROBS per token, a chunk of tokens at a time."""
        t = h.shape[0]
        chunk = min(PROMPT_LOGPROB_CHUNK, t)
        pad = -t % chunk
        hs = jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, chunk, h.shape[-1])
        ts = jnp.pad(targets, (0, pad)).reshape(-1, chunk)

        def one(args):
            hc, tc = args
            lp = jax.nn.log_softmax(model.logits(hc), axis=-1)
            top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
            return jnp.take_along_axis(lp, jnp.maximum(tc, 0)[:, None], axis=-1)[:, 0], top_ids, top_lp

        target, ids, lps = jax.lax.map(one, (hs, ts))
        return (
            target.reshape(-1)[:t],
            ids.reshape(-1, MAX_LOGPROBS)[:t].astype(jnp.int32),
            lps.reshape(-1, MAX_LOGPROBS)[:t],
        )

    def step(self, state, caches, buffers, prev_tokens, *, layout, max_q_len):
        """One step: forward over the flat batch, sampling, prompt logprobs where asked."""
        self._traced()
        inputs, sampling = unpack(buffers, layout)
        return self._sharded(self._forward_and_sample, state, caches, inputs, sampling, prev_tokens, max_q_len)

    def _hidden(self, state, caches, inputs, prev_tokens, max_q_len, options=ForwardOptions()):
        """The model, the flat batch's last hidden states [T, D], the KV pools updated, and the router
        stats `options` ask for (the batch's padding not counted)."""
        model, stack = self._model(state)
        meta = self._meta(inputs, inputs.kv_lens, inputs.slot_mapping, max_q_len)
        ids = self._input_ids(inputs, prev_tokens)
        valid = inputs.slot_mapping[None] >= 0
        lora = self._lora(state, inputs.lora_slots)
        h, caches, stats = model.hidden_states(
            ids[None], inputs.positions[None], meta, caches, stack, options, valid, lora
        )
        return model, h[0], caches, stats

    def _hidden_counted(self, state, caches, inputs, prev_tokens, max_q_len):
        """`_hidden` with, for an MoE model, the token copies each expert took [MoE layers, experts]
        in place of the stats (None for a dense model)."""
        model, h, caches, stats = self._hidden(state, caches, inputs, prev_tokens, max_q_len, COUNTED)
        return model, h, caches, None if stats is None else stats.counts

    def verify(self, state, caches, buffers, prev_tokens, device_drafts, *, layout, max_q_len):
        """A speculative verify step (drafts and their logit indices packed after the inputs; the draft
        model's, made on device this step, in `device_drafts`, else None)."""
        self._traced()
        inputs, sampling, drafts, indices = unpack(buffers, layout)
        if device_drafts is not None:
            drafts = device_drafts
            inputs = dataclasses.replace(inputs, input_ids=with_drafts(inputs.input_ids, drafts, indices))
        return self._sharded(
            self._forward_and_verify, state, caches, inputs, sampling, drafts, indices, prev_tokens, max_q_len
        )

    def _forward_and_verify(self, state, caches, inputs, sampling, drafts, indices, prev_tokens, max_q_len):
        """Speculative decoding: the target's logits at each row's last token and drafts, and the
        rejection sampler's tokens [S, k+1] (what the next step feeds: each row's last emitted)."""
        model, h, caches, load = self._hidden_counted(state, caches, inputs, prev_tokens, max_q_len)
        s, k1 = indices.shape
        logits = model.logits(h[indices.reshape(-1)]).reshape(s, k1, -1)
        out = rejection_sample(drafts, None, logits, sampling, eos_ids=self.layout.eos_token_ids)
        last = jnp.take_along_axis(out.tokens, (out.num_emitted - 1)[:, None], axis=1)[:, 0]
        none = jnp.zeros((s, MAX_LOGPROBS), jnp.int32)
        sampled = SamplerOutput(out.tokens, jnp.zeros((s,), jnp.float32), none, none.astype(jnp.float32))
        return sampled, out.num_emitted, self._padded(last), caches, load, *self._hidden_out(h)

    def _forward_and_sample(self, state, caches, inputs, sampling, prev_tokens, max_q_len):
        model, h, caches, load = self._hidden_counted(state, caches, inputs, prev_tokens, max_q_len)
        logits = model.logits(h[inputs.logits_indices])
        out = sample(logits, sampling, eos_ids=self.layout.eos_token_ids)
        targets = inputs.prompt_targets
        t = targets.shape[0]
        zeros = lambda: (
            jnp.zeros((t,), jnp.float32),
            jnp.zeros((t, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((t, MAX_LOGPROBS), jnp.float32),
        )
        prompt = jax.lax.cond(jnp.any(targets >= 0), lambda: self._prompt_logprobs(model, h, targets), zeros)
        return out, self._padded(out.tokens), logits, prompt, caches, load, *self._hidden_out(h)

    def _hidden_out(self, h: jax.Array) -> tuple[jax.Array, ...]:
        """The hidden states as an extra output when asked for (return_hidden), else nothing."""
        return (h,) if self.return_hidden else ()

    def resample(self, logits, buffers, *, layout):
        """Sample again from a step's logits with penalties, logit_bias and the grammar bitmask."""
        self._traced()
        sampling, history, is_output, bitmask, bias_ids, bias_values = unpack(buffers, layout)
        s, v = logits.shape
        biased = (
            apply_penalties(logits, sampling, history, is_output)
            .at[jnp.arange(s)[:, None], jnp.where(bias_ids < 0, v, bias_ids)]
            .add(bias_values, mode="drop")
        )
        out = sample(
            apply_bitmask(biased, bitmask),
            sampling,
            eos_ids=self.layout.eos_token_ids,
            raw_logits=logits,
        )
        return out, self._padded(out.tokens)

    def multi(self, state, caches, buffers, prev_tokens, *, layout, num_steps):
        """The decode loop (its per-row budgets and the step id packed after the inputs)."""
        self._traced()
        inputs, sampling, budgets, step_id = unpack(buffers, layout)
        args = (state, caches, inputs, sampling, prev_tokens, budgets, step_id, num_steps)
        return self._sharded(self._decode_loop, *args)

    def _decode_loop(self, state, caches, inputs, sampling, prev_tokens, budgets, step_id, num_steps):
        """Up to num_steps decode steps; a row stops by the host's stop rule (`stop_code`) or at its budget,
        and the loop ends early once every row has stopped; each iteration's tokens go to `loop_tap`
        as they are made, when set. Tokens [K, S], -1 where none, each row's
        last token (padded to max_num_seqs: what the next step feeds from the device), for an MoE
        model the token copies each expert took over the loop, and the tap's last receipt."""
        model, stack = self._model(state)
        lora = self._lora(state, inputs.lora_slots)  # a decode row's slot stays its slot for the whole loop
        s = budgets.shape[0]
        eos = jnp.asarray(self.layout.eos_token_ids or (-1,), jnp.int32)
        rows = jnp.arange(s)
        positions0, kv0, tables = inputs.positions, inputs.kv_lens, inputs.block_tables

        def body(carry):
            i, ids, last, active, caches, acc, load, receipt = carry
            pos = positions0 + i
            block = tables[rows, jnp.minimum(pos // self.block_size, tables.shape[1] - 1)]
            slots = jnp.where(active, block * self.block_size + pos % self.block_size, -1)
            meta = self._meta(inputs, jnp.where(active, kv0 + i, 0), slots, 1, jnp.where(active, pos, -1))
            h, caches, stats = model.hidden_states(
                ids[None], pos[None], meta, caches, stack, COUNTED, active[None], lora
            )
            t = dataclasses.replace(sampling, out_pos=sampling.out_pos + i)
            out = sample(model.logits(h[0]), t, eos_ids=self.layout.eos_token_ids)
            is_eos = jnp.any(out.tokens[:, None] == eos[None, :], axis=1)
            is_stop_id = jnp.any(out.tokens[:, None] == t.stop_ids, axis=1)
            code = jnp.where(active, stop_code(is_eos, is_stop_id, t.out_pos + 1, t.min_tokens, ~t.ignore_eos), 0)
            stopped = (code > 0) | (i + 1 >= budgets)
            if self.loop_tap is not None:  # per row: its token (-1: none), its stop code (serve.core.sequence)
                receipt = self.loop_tap(jnp.concatenate([step_id, i[None], jnp.where(active, out.tokens, -1), code]))
            acc = jax.tree.map(
                lambda a, x: a.at[i].set(x),
                acc,
                (jnp.where(active, out.tokens, -1), out.logprob, out.top_ids, out.top_logprobs),
            )
            load = None if load is None or stats is None else load + stats.counts
            return i + 1, out.tokens, jnp.where(active, out.tokens, last), active & ~stopped, caches, acc, load, receipt

        acc = (
            jnp.full((num_steps, s), -1, jnp.int32),
            jnp.zeros((num_steps, s), jnp.float32),
            jnp.zeros((num_steps, s, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((num_steps, s, MAX_LOGPROBS), jnp.float32),
        )
        ids = self._input_ids(inputs, prev_tokens)
        moe_layers = sum(self.cfg.is_moe_layer(i) for i in range(self.cfg.num_layers))
        load = jnp.zeros((moe_layers, self.cfg.num_experts), jnp.int32) if moe_layers else None
        init = (jnp.int32(0), ids, ids, budgets > 0, caches, acc, load, jnp.zeros((1,), jnp.int32))
        _, _, last, _, caches, (tokens, lp, top_ids, top_lp), load, receipt = jax.lax.while_loop(
            lambda c: (c[0] < num_steps) & jnp.any(c[3]), body, init
        )
        return SamplerOutput(tokens, lp, top_ids, top_lp), self._padded(last), caches, load, receipt
