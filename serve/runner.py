"""Model runner: packs scheduled tokens into bucketed flat batches and runs the jitted device steps.

A step is model forward over the flat ragged batch with paged attention (the KV pools donated and
updated in place), logits only where a token is sampled, and sampling on device. Shapes are padded
to a few buckets (tokens, sequences, block-table width, decode-only or not), and every request
option is data, so after `warmup()` nothing compiles again. Steps are dispatched asynchronously:
`dispatch` returns at once and `fetch` waits; a decode whose previous token is still on the device
reads it there. A decode-only batch may run `num_steps` decode steps inside one jitted loop.
Penalties and structured-output masks resample the step's logits in a second jitted call; the host
fills the masks while the first call runs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int
from tqdm import tqdm

from jaxinfra.config import ModelConfig
from jaxinfra.models import LlamaModel
from jaxinfra.models.llama import LayerStack, layer_graph, merge_params, stack_layers, unstack_layers
from pallas_kernels import (
    PagedKVCache,
    PagedMetadata,
    addressable_blocks,
    kv_bytes_per_element,
    paged_head_dim,
    paged_impl,
    tile_plan,
)
from pallas_kernels.kv_quant import is_quantized_kv
from pallas_kernels.paged_tiles import TilePlan, kernel_work_list
from pallas_kernels.ragged_paged_attention import kernel_tile_tokens
from pallas_kernels.ragged_paged_attention_xla import tile_tokens
from serve.config import kv_storage_dtype
from serve.host_transfer import pack, unpack
from serve.sampler import (
    ROW_FIELDS,
    SamplerOutput,
    SamplingTensors,
    apply_bitmask,
    apply_penalties,
    row_settings,
    sample,
)
from serve.sampling_params import MAX_BANNED_STOP_IDS, MAX_LOGIT_BIAS, MAX_LOGPROBS
from serve.scheduler import SchedulerOutput, StepResult
from serve.sequence import Sequence, stops
from serve.spec_decode import rejection_sample
from serve.spec_decode.verify_batch import verify_arrays
from serve.structured_output import GrammarCompiler, bitmask_words
from sharding import get_rules, logical_rules, named_sharding, shard_state, tensor_parallel_mesh

PROMPT_LOGPROB_CHUNK = 128  # prompt tokens whose full-vocabulary logprobs are computed at once


def buckets(limit: int, start: int, factor: int = 2) -> list[int]:
    """start, start * factor, ... capped at limit (which is always the last bucket)."""
    out = [min(start, limit)]
    while out[-1] < limit:
        out.append(min(out[-1] * factor, limit))
    return out


def fit(n: int, options: list[int]) -> int:
    for b in options:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {options[-1]}")


def num_blocks_for_memory(
    cfg: ModelConfig, block_size: int, kv_dtype: str, memory_bytes: int, attn_impl: str | None = None
) -> int:
    """KV blocks (every layer's K and V pools) that `memory_bytes` hold, within what Triton addresses."""
    dtype = kv_storage_dtype(kv_dtype, cfg.dtype)
    d = paged_head_dim(cfg.head_dim, paged_impl(attn_impl))
    per_block = 2 * cfg.num_layers * cfg.num_kv_heads * d * kv_bytes_per_element(dtype, d)
    num_blocks = int(memory_bytes // (per_block * block_size))
    block_elements = block_size * cfg.num_kv_heads * d
    # every layer's blocks form one pool (stacked on a layers axis): it must be addressable whole
    return addressable_blocks(num_blocks * cfg.num_layers, block_elements, jnp.dtype(dtype).itemsize) // cfg.num_layers


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """A step's token-level inputs: numpy on the host, device arrays inside the jitted step."""

    input_ids: Int[Array, " T"]
    prev_index: Int[Array, " T"]  # >= 0: feed prev_tokens[prev_index] (sampled by the previous step)
    positions: Int[Array, " T"]
    slot_mapping: Int[Array, " T"]
    block_tables: Int[Array, "S W"]
    cu_q_lens: Int[Array, " S1"]
    kv_lens: Int[Array, " S"]
    logits_indices: Int[Array, " S"]  # the token whose logits each row samples from
    prompt_targets: Int[Array, " T"] | None = None  # single steps: the next prompt token to score, or -1
    plan: TilePlan | None = None  # the XLA attention's work tiles
    work: Int[Array, "N 2"] | None = None  # the Pallas kernel's work list


@dataclasses.dataclass
class StepBatch:
    """One device step, prepared on the host: the scheduler's output and the arrays to send."""

    sched: SchedulerOutput
    inputs: StepInputs
    sampling: SamplingTensors
    max_q_len: int
    budget: np.ndarray | None = None  # decode loop: [sb] steps each row runs (padding rows 0)
    history: tuple[np.ndarray, np.ndarray] | None = None  # resampling: [S, L] ids and is-output flags
    prompt_logprobs: bool = False
    grammar_rows: list[tuple[Any, int]] = dataclasses.field(default_factory=list)  # (matcher, row) to mask
    bias: tuple[np.ndarray, np.ndarray] | None = None  # resampling: logit_bias [S, MAX_LOGIT_BIAS] ids, values
    spec: tuple[np.ndarray, np.ndarray] | None = None  # verify step: drafts [S, k], target logit indices [S, k+1]


@dataclasses.dataclass
class InFlight:
    """A dispatched step: its batch and the device arrays it will fill."""

    batch: StepBatch
    out: SamplerOutput
    prompt: tuple[jax.Array, ...]  # prompt logprob arrays, empty for a decode loop
    num_emitted: jax.Array | None = None  # verify step: tokens each row emitted (out.tokens [S, k+1])

    def wait(self) -> None:
        """Block until the device has finished the step."""
        jax.block_until_ready(self.out.tokens)

    def fetch(self) -> StepResult:
        want_lp = any(s.params.logprobs is not None for s in self.batch.sched.seqs)
        arrays = [self.out.tokens, *((self.out.logprob, self.out.top_ids, self.out.top_logprobs) if want_lp else ())]
        if self.batch.prompt_logprobs:
            arrays += list(self.prompt)
        host = jax.device_get([*arrays, *(() if self.num_emitted is None else (self.num_emitted,))])
        res = StepResult(host[0], None if self.num_emitted is None else host.pop())
        if want_lp:
            res.logprobs = (host[1], host[2], host[3])
        if self.batch.prompt_logprobs:
            res.prompt_logprobs = (host[-3], host[-2], host[-1])
        return res


class SlotTable:
    """Per-sequence rows kept across steps (vLLM's persistent batch): a sequence's sampling settings
    are written once, when it is first scheduled, and its block ids as it grows; a step gathers its
    rows with one indexing operation per field instead of a Python loop."""

    def __init__(self, capacity: int, max_blocks: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.blocks = np.zeros((capacity, max_blocks), np.int32)
        self.num_blocks = np.zeros(capacity, np.int32)
        self.settings: dict[str, np.ndarray] = {
            name: np.full(capacity, pad, dtype) for name, (dtype, pad) in ROW_FIELDS.items()
        }
        self.stop_ids = np.full((capacity, MAX_BANNED_STOP_IDS), -1, np.int32)
        self.prompt_len = np.zeros(capacity, np.int32)
        self.resample = np.zeros(capacity, bool)  # penalties, a structured output or a logit bias
        self.bias_ids = np.full((capacity, MAX_LOGIT_BIAS), -1, np.int32)
        self.bias_values = np.zeros((capacity, MAX_LOGIT_BIAS), np.float32)
        self.prompt_logprobs = np.zeros(capacity, bool)
        self.slot_of: dict[int, int] = {}
        self.free = list(range(capacity - 1, -1, -1))

    def row(self, seq: Sequence) -> int:
        """The sequence's row, written on first use; its block ids brought up to date."""
        slot = self.slot_of.get(seq.seq_id)
        if slot is None:
            slot = self.slot_of[seq.seq_id] = self.free.pop()
            p = seq.params
            for name, value in row_settings(p, seq.seed, seq.index, self.vocab_size).items():
                self.settings[name][slot] = value
            ids = p.stop_token_ids[:MAX_BANNED_STOP_IDS]
            self.stop_ids[slot] = -1
            self.stop_ids[slot, : len(ids)] = ids
            self.prompt_len[slot] = seq.prompt_len
            self.resample[slot] = p.uses_penalties or p.structured_outputs is not None or bool(p.logit_bias)
            bias = p.logit_bias or {}
            self.bias_ids[slot], self.bias_values[slot] = -1, 0.0
            self.bias_ids[slot, : len(bias)] = list(bias)
            self.bias_values[slot, : len(bias)] = list(bias.values())
            self.prompt_logprobs[slot] = seq.wants_prompt_logprobs
            self.num_blocks[slot] = 0
        have, want = int(self.num_blocks[slot]), len(seq.block_ids)
        if have != want:
            have = have if have < want else 0  # blocks only grow while a sequence keeps its row
            self.blocks[slot, have:want] = seq.block_ids[have:]
            self.num_blocks[slot] = want
        return slot

    def release(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.free.append(slot)

    def bias(self, rows: np.ndarray, sb: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows' logit_bias (ids, values) [sb, MAX_LOGIT_BIAS]; -1 ids pad."""
        ids, values = np.full((sb, MAX_LOGIT_BIAS), -1, np.int32), np.zeros((sb, MAX_LOGIT_BIAS), np.float32)
        ids[: len(rows)], values[: len(rows)] = self.bias_ids[rows], self.bias_values[rows]
        return ids, values

    def sampling(self, rows: np.ndarray, sb: int, out_pos: np.ndarray) -> SamplingTensors:
        """The sampler's [sb] rows: the given rows, then padding rows (greedy, no filters)."""
        n = len(rows)

        def padded(col: np.ndarray, pad: float | int | bool, values: np.ndarray) -> np.ndarray:
            out = np.full((sb, *col.shape[1:]), pad, col.dtype)
            out[:n] = values
            return out

        fields: dict[str, Any] = {
            name: padded(col, ROW_FIELDS[name][1], col[rows]) for name, col in self.settings.items()
        }
        fields["out_pos"] = padded(self.prompt_len, 0, out_pos)
        fields["stop_ids"] = padded(self.stop_ids, -1, self.stop_ids[rows])
        return SamplingTensors(**fields)  # numpy here; jax arrays inside the jitted step


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        *,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        kv_cache_dtype: str = "auto",
        eos_token_ids: tuple[int, ...] = (),
        tensor_parallel_size: int = 1,
        attn_impl: str | None = None,
        num_scheduler_steps: int = 1,
        num_speculative_tokens: int = 0,
    ) -> None:
        """`num_speculative_tokens` (k > 0): verify steps, k drafts a row, are compiled at warm-up."""
        cfg = model.cfg
        self.cfg = cfg
        self.eos_token_ids = tuple(eos_token_ids)  # held back, with stop_token_ids, until min_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_blocks = math.ceil(max_model_len / block_size)
        self.num_scheduler_steps = num_scheduler_steps
        self.num_speculative_tokens = num_speculative_tokens
        self.attn_impl = paged_impl(attn_impl)
        self.graphdef, self.state = nnx.split(model)
        dtype = kv_storage_dtype(kv_cache_dtype, cfg.dtype)
        # One pool for every layer, stacked on a leading layers axis: the layers run as one scan.
        self.kv_cache = PagedKVCache.zeros(
            num_blocks,
            block_size,
            cfg.num_kv_heads,
            paged_head_dim(cfg.head_dim, self.attn_impl),
            dtype,
            num_layers=cfg.num_layers,
        )
        self.rules = get_rules("tp")
        self.mesh = None
        if tensor_parallel_size > 1:  # weights and KV pools split over KV heads
            self.mesh = tensor_parallel_mesh(tensor_parallel_size, cfg.num_kv_heads)
            self.state = shard_state(self.state, self.mesh, self.rules.params)
            axes, mesh = (None, None, None, "kv_heads", "head_dim"), self.mesh
            self.kv_cache = jax.tree.map(
                lambda a: jax.device_put(a, named_sharding(axes[: a.ndim], self.rules.params, a.shape, mesh)),
                self.kv_cache,
            )
        params = nnx.to_pure_dict(self.state)
        self.template = list(nnx.to_flat_state(self.state))
        try:  # identical layers: their weights stacked once here, scanned in every step
            self.layer_graph: tuple[nnx.GraphDef, list] | None = layer_graph(model.layers)
            params = stack_layers(params)
        except ValueError:
            self.layer_graph = None
        # The weights travel as a flat list: flattening a pytree of them on every call costs more than the step.
        self.weights, self.state_def = jax.tree.flatten(params)
        self.token_buckets = buckets(max_num_batched_tokens, min(16, max_num_batched_tokens), factor=4)
        self.seq_buckets = buckets(max_num_seqs, 1)
        # Block-table columns (both attention implementations read only the pages a batch uses); below
        # 16 pages a narrower table saves less than its compiled shapes cost at start-up.
        self.width_buckets = buckets(self.max_blocks, min(16, self.max_blocks), factor=4)
        self.slots = SlotTable(2 * max_num_seqs, self.max_blocks, cfg.vocab_size)
        self.num_compilations = 0
        self._no_prev = jnp.zeros((max_num_seqs,), jnp.int32)
        self.prev_tokens = self._no_prev  # the last single step's sampled tokens, on device
        self.prev_rows: dict[int, int] = {}  # seq_id -> its row in prev_tokens
        self._step = jax.jit(self._step_impl, donate_argnums=(1,), static_argnames=("layout", "max_q_len"))
        self._multi = jax.jit(self._multi_impl, donate_argnums=(1,), static_argnames=("layout", "num_steps"))
        self._resample = jax.jit(self._resample_impl, static_argnames=("layout",))
        self._verify = jax.jit(self._verify_impl, donate_argnums=(1,), static_argnames=("layout", "max_q_len"))
        self.grammar: GrammarCompiler | None = None  # set by the engine core with its first structured request

    # --- device side ------------------------------------------------------------------------------
    def _traced(self) -> None:
        self.num_compilations += 1  # runs only while tracing: counts compilations

    def _model(self, weights: list) -> tuple[LlamaModel, LayerStack | None]:
        """The model (inside a jitted step) and, when its layers are stacked, the stack to scan."""
        params = jax.tree.unflatten(self.state_def, weights)
        if self.layer_graph is None:
            return merge_params(self.graphdef, self.template, params), None
        # the per-layer slices serve the template only: the scan reads the stack, XLA drops the slices
        per_layer = unstack_layers(params, self.cfg.num_layers)
        return merge_params(self.graphdef, self.template, per_layer), LayerStack(*self.layer_graph, params["layers"])

    def _sharded(self, fn, *args, **kwargs):
        if self.mesh is None:
            return fn(*args, **kwargs)
        with logical_rules(self.mesh, self.rules.activations):
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
        return jnp.zeros((self.max_num_seqs,), jnp.int32).at[: tokens.shape[0]].set(tokens)

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

    def _step_impl(self, state, caches, buffers, prev_tokens, *, layout, max_q_len):
        self._traced()
        inputs, sampling = unpack(buffers, layout)
        return self._sharded(self._forward_and_sample, state, caches, inputs, sampling, prev_tokens, max_q_len)

    def _hidden(self, state, caches, inputs, prev_tokens, max_q_len):
        """The model and the flat batch's last hidden states [T, D] (the KV pools updated)."""
        model, stack = self._model(state)
        meta = self._meta(inputs, inputs.kv_lens, inputs.slot_mapping, max_q_len)
        ids = self._input_ids(inputs, prev_tokens)
        h, caches = model.hidden_states(ids[None], inputs.positions[None], meta, caches, stack)
        return model, h[0], caches

    def _verify_impl(self, state, caches, buffers, prev_tokens, *, layout, max_q_len):
        self._traced()
        inputs, sampling, drafts, indices = unpack(buffers, layout)
        return self._sharded(
            self._forward_and_verify, state, caches, inputs, sampling, drafts, indices, prev_tokens, max_q_len
        )

    def _forward_and_verify(self, state, caches, inputs, sampling, drafts, indices, prev_tokens, max_q_len):
        """Speculative decoding: the target's logits at each row's last token and drafts, and the
        rejection sampler's tokens [S, k+1] (what the next step feeds: each row's last emitted)."""
        model, h, caches = self._hidden(state, caches, inputs, prev_tokens, max_q_len)
        s, k1 = indices.shape
        logits = model.logits(h[indices.reshape(-1)]).reshape(s, k1, -1)
        out = rejection_sample(drafts, None, logits, sampling, eos_ids=self.eos_token_ids)
        last = jnp.take_along_axis(out.tokens, (out.num_emitted - 1)[:, None], axis=1)[:, 0]
        none = jnp.zeros((s, MAX_LOGPROBS), jnp.int32)
        sampled = SamplerOutput(out.tokens, jnp.zeros((s,), jnp.float32), none, none.astype(jnp.float32))
        return sampled, out.num_emitted, self._padded(last), caches

    def _forward_and_sample(self, state, caches, inputs, sampling, prev_tokens, max_q_len):
        model, h, caches = self._hidden(state, caches, inputs, prev_tokens, max_q_len)
        logits = model.logits(h[inputs.logits_indices])
        out = sample(logits, sampling, eos_ids=self.eos_token_ids)
        targets = inputs.prompt_targets
        t = targets.shape[0]
        zeros = lambda: (
            jnp.zeros((t,), jnp.float32),
            jnp.zeros((t, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((t, MAX_LOGPROBS), jnp.float32),
        )
        prompt = jax.lax.cond(jnp.any(targets >= 0), lambda: self._prompt_logprobs(model, h, targets), zeros)
        return out, self._padded(out.tokens), logits, prompt, caches

    def _resample_impl(self, logits, buffers, *, layout):
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
            eos_ids=self.eos_token_ids,
            raw_logits=logits,
        )
        return out, self._padded(out.tokens)

    def _multi_impl(self, state, caches, buffers, prev_tokens, *, layout, num_steps):
        self._traced()
        inputs, sampling, budget = unpack(buffers, layout)
        return self._sharded(self._decode_loop, state, caches, inputs, sampling, prev_tokens, budget, num_steps)

    def _decode_loop(self, state, caches, inputs, sampling, prev_tokens, budget, num_steps):
        """Up to num_steps decode steps; a row stops by the host's stop rule (`stops`) or at its budget,
        and the loop ends early once every row has stopped. Tokens [K, S], -1 where none, and each
        row's last token (padded to max_num_seqs: what the next step feeds from the device)."""
        model, stack = self._model(state)
        s = budget.shape[0]
        eos = jnp.asarray(self.eos_token_ids or (-1,), jnp.int32)
        rows = jnp.arange(s)
        positions0, kv0, tables = inputs.positions, inputs.kv_lens, inputs.block_tables

        def body(carry):
            i, ids, last, active, caches, acc = carry
            pos = positions0 + i
            block = tables[rows, jnp.minimum(pos // self.block_size, tables.shape[1] - 1)]
            slots = jnp.where(active, block * self.block_size + pos % self.block_size, -1)
            meta = self._meta(inputs, jnp.where(active, kv0 + i, 0), slots, 1, jnp.where(active, pos, -1))
            h, caches = model.hidden_states(ids[None], pos[None], meta, caches, stack)
            t = dataclasses.replace(sampling, out_pos=sampling.out_pos + i)
            out = sample(model.logits(h[0]), t, eos_ids=self.eos_token_ids)
            is_eos = jnp.any(out.tokens[:, None] == eos[None, :], axis=1)
            is_stop_id = jnp.any(out.tokens[:, None] == t.stop_ids, axis=1)
            stopped = stops(is_eos, is_stop_id, t.out_pos + 1, t.min_tokens, ~t.ignore_eos) | (i + 1 >= budget)
            acc = jax.tree.map(
                lambda a, x: a.at[i].set(x),
                acc,
                (jnp.where(active, out.tokens, -1), out.logprob, out.top_ids, out.top_logprobs),
            )
            return i + 1, out.tokens, jnp.where(active, out.tokens, last), active & ~stopped, caches, acc

        acc = (
            jnp.full((num_steps, s), -1, jnp.int32),
            jnp.zeros((num_steps, s), jnp.float32),
            jnp.zeros((num_steps, s, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((num_steps, s, MAX_LOGPROBS), jnp.float32),
        )
        ids = self._input_ids(inputs, prev_tokens)
        init = (jnp.int32(0), ids, ids, budget > 0, caches, acc)
        _, _, last, _, caches, (tokens, lp, top_ids, top_lp) = jax.lax.while_loop(
            lambda c: (c[0] < num_steps) & jnp.any(c[3]), body, init
        )
        return SamplerOutput(tokens, lp, top_ids, top_lp), self._padded(last), caches

    # --- host side --------------------------------------------------------------------------------
    def free_rows(self, sched: SchedulerOutput) -> None:
        """Free the rows of sequences that left the batch (finished, aborted or preempted) since the
        last step; the engine calls it for steps that schedule nothing too, so no row leaks."""
        for seq_id in sched.finished:
            self.slots.release(seq_id)
        for seq in sched.preempted:
            self.slots.release(seq.seq_id)

    def prepare(self, sched: SchedulerOutput) -> StepBatch:
        """Host arrays for one step (or a multi-step decode loop), from the scheduler's output; rows of
        sequences that left the batch are freed first."""
        self.free_rows(sched)
        table = self.slots
        seqs, num_steps = sched.seqs, sched.num_steps
        n_seq = len(seqs)
        rows = np.fromiter((table.row(s) for s in seqs), np.int32, n_seq)
        counts, starts, pending, num_tokens = sched.num_new, sched.num_computed, sched.num_pending, sched.num_tokens
        n_tok = int(counts.sum())
        decode_only = int(counts.max(initial=0)) <= 1
        # Decodes: one token per sequence slot; batches with a prompt chunk: token buckets, every sequence slot.
        sb = fit(n_seq, self.seq_buckets) if decode_only else self.max_num_seqs
        tb = sb if decode_only else fit(n_tok, self.token_buckets)
        cu = np.zeros(sb + 1, np.int32)
        np.cumsum(counts, out=cu[1 : n_seq + 1])
        cu[n_seq + 1 :] = cu[n_seq]
        seq_of_tok = np.repeat(np.arange(n_seq), counts)
        positions = np.zeros(tb, np.int32)
        positions[:n_tok] = starts[seq_of_tok] + np.arange(n_tok) - cu[seq_of_tok]
        width = fit(int(table.num_blocks[rows].max()), self.width_buckets)
        block_tables = np.zeros((sb, width), np.int32)
        block_tables[:n_seq] = table.blocks[rows, :width]
        input_ids = np.zeros(tb, np.int32)
        prev_index = np.full(tb, -1, np.int32)
        if decode_only:  # each sequence feeds its last token, or the one still on the device
            has_prev = pending > 0
            input_ids[:n_seq] = [0 if p else s.tokens[-1] for s, p in zip(seqs, has_prev.tolist())]
            if has_prev.any():
                prev_index[:n_seq][has_prev] = [self.prev_rows[s.seq_id] for s, p in zip(seqs, has_prev) if p]
        else:
            drafts = sched.draft_ids
            for i, (s, n, start) in enumerate(zip(seqs, counts.tolist(), starts.tolist())):
                known = s.tokens if drafts is None else s.tokens + [t for t in drafts[i].tolist() if t >= 0]
                if start + n <= len(known):
                    input_ids[cu[i] : cu[i] + n] = known[start : start + n]
                else:  # a decode of the token the previous step is still sampling on the device
                    prev_index[cu[i]] = self.prev_rows[s.seq_id]
        slots = np.full(tb, -1, np.int32)
        p = positions[:n_tok]
        slots[:n_tok] = block_tables[seq_of_tok, p // self.block_size] * self.block_size + p % self.block_size
        kv_lens = np.zeros(sb, np.int32)
        kv_lens[:n_seq] = starts + counts
        logits_indices = np.zeros(sb, np.int32)
        logits_indices[:n_seq] = cu[1 : n_seq + 1] - 1
        out_pos = num_tokens - table.prompt_len[rows]
        max_q_len = 1 if decode_only else tb
        targets = None
        prompt_logprobs = False
        if num_steps == 1:
            targets = np.full(tb, -1, np.int32)
            if table.prompt_logprobs[rows].any():
                for i, (s, n, start) in enumerate(zip(seqs, counts.tolist(), starts.tolist())):
                    if s.wants_prompt_logprobs and start < s.prompt_len:
                        nxt = s.tokens[start + 1 : min(start + n + 1, s.prompt_len)]
                        targets[cu[i] : cu[i] + len(nxt)] = nxt
                        prompt_logprobs = True
        budget, plan_kv = None, kv_lens
        if sched.budgets is not None:
            budget = np.zeros(sb, np.int32)
            budget[:n_seq] = sched.budgets
            plan_kv = kv_lens + np.maximum(budget - 1, 0)  # pages up to the last token the loop may write
        columns: dict[str, Any] = dict(
            input_ids=input_ids,
            prev_index=prev_index,
            positions=positions,
            slot_mapping=slots,
            block_tables=block_tables,
            cu_q_lens=cu,
            kv_lens=kv_lens,
            logits_indices=logits_indices,
            prompt_targets=targets,
        )
        inputs = StepInputs(**columns, **self._work_tiles(cu, block_tables, plan_kv, tb, max_q_len))
        sampling = table.sampling(rows, sb, out_pos)
        batch = StepBatch(sched, inputs, sampling, max_q_len, budget, prompt_logprobs=prompt_logprobs)
        if sched.draft_ids is not None:
            batch.spec = verify_arrays(sched.draft_ids, logits_indices[:n_seq], sb)
        if budget is None and table.resample[rows].any():
            batch.history = self._history(seqs, sb)
            batch.bias = table.bias(rows, sb)
            samples = sched.samples
            batch.grammar_rows = [(s.matcher, i) for i, s in enumerate(seqs) if s.matcher is not None and samples[i]]
        return batch

    def _work_tiles(
        self, cu: np.ndarray, block_tables: np.ndarray, kv_lens: np.ndarray, tb: int, max_q_len: int
    ) -> dict[str, Any]:
        """The attention's work tiles, built here on the host: a tile plan (XLA) or a work list (Pallas)."""
        if self.attn_impl == "xla":
            tokens = tile_tokens(max_q_len, tb)
            return {"plan": tile_plan(cu, kv_lens, block_tables, self.block_size, tb, tokens, np)}
        if self.attn_impl == "pallas":
            pool = self.kv_cache.k
            group = self.cfg.num_heads // self.cfg.num_kv_heads
            tokens = kernel_tile_tokens(group, pool.shape[-1], max_q_len, is_quantized_kv(pool.dtype))
            return {"work": kernel_work_list(cu, tb, tokens, np)}
        return {}

    def _history(self, seqs: list[Sequence], sb: int) -> tuple[np.ndarray, np.ndarray]:
        history = np.full((sb, self.max_model_len), -1, np.int32)
        is_out = np.zeros((sb, self.max_model_len), bool)
        for i, s in enumerate(seqs):
            history[i, : len(s.tokens)] = s.tokens
            is_out[i, s.prompt_len : len(s.tokens)] = True
        return history, is_out

    def dispatch(self, batch: StepBatch) -> InFlight:
        """Start the step on the device; returns at once (JAX dispatches asynchronously)."""
        seqs = batch.sched.seqs
        if batch.budget is not None:
            buffers, layout = pack((batch.inputs, batch.sampling, batch.budget))
            out, self.prev_tokens, self.kv_cache = self._multi(
                self.weights, self.kv_cache, buffers, self.prev_tokens, layout=layout, num_steps=batch.sched.num_steps
            )
            self.prev_rows = {s.seq_id: i for i, s in enumerate(seqs)}
            return InFlight(batch, out, ())
        if batch.spec is not None:
            buffers, layout = pack((batch.inputs, batch.sampling, *batch.spec))
            out, num_emitted, self.prev_tokens, self.kv_cache = self._verify(
                self.weights, self.kv_cache, buffers, self.prev_tokens, layout=layout, max_q_len=batch.max_q_len
            )
            self.prev_rows = {s.seq_id: i for i, s in enumerate(seqs)}
            return InFlight(batch, out, (), num_emitted)
        buffers, layout = pack((batch.inputs, batch.sampling))
        out, padded, logits, prompt, self.kv_cache = self._step(
            self.weights, self.kv_cache, buffers, self.prev_tokens, layout=layout, max_q_len=batch.max_q_len
        )
        if batch.history is not None:
            sb = batch.history[0].shape[0]
            bitmask = np.full((sb, bitmask_words(self.cfg.vocab_size)), -1, np.int32)
            if batch.grammar_rows:
                assert self.grammar is not None
                self.grammar.fill(batch.grammar_rows, bitmask)  # while the forward pass runs
            bias = batch.bias or self.slots.bias(np.zeros(0, np.int32), sb)
            buffers, layout = pack((batch.sampling, *batch.history, bitmask, *bias))
            out, padded = self._resample(logits, buffers, layout=layout)
        self.prev_tokens = padded
        self.prev_rows = {s.seq_id: i for i, s in enumerate(seqs)}
        return InFlight(batch, out, prompt)

    def compiled_text(self, batch: StepBatch) -> str:
        """The optimised HLO a batch of this shape runs (for checks such as "no KV pool is copied")."""
        if batch.budget is not None:
            buffers, layout = pack((batch.inputs, batch.sampling, batch.budget))
            lowered = self._multi.lower(
                self.weights, self.kv_cache, buffers, self.prev_tokens, layout=layout, num_steps=batch.sched.num_steps
            )
        else:
            buffers, layout = pack((batch.inputs, batch.sampling))
            lowered = self._step.lower(
                self.weights, self.kv_cache, buffers, self.prev_tokens, layout=layout, max_q_len=batch.max_q_len
            )
        return lowered.compile().as_text() or ""

    # --- warm-up ----------------------------------------------------------------------------------
    def shapes(self) -> list[tuple[int, int, int, int]]:
        """Every (tokens, sequences, block-table width, max_q_len) a step can have: decode-only
        batches (one token per sequence bucket slot) and batches with a prompt chunk."""
        decode = [(sb, sb, w, 1) for sb in self.seq_buckets for w in self.width_buckets]
        return decode + [(tb, self.max_num_seqs, w, tb) for tb in self.token_buckets for w in self.width_buckets]

    def dummy(self, tb: int, sb: int, width: int, q: int, num_steps: int = 1) -> StepBatch:
        """An empty batch of the given shape (what warm-up compiles)."""
        cu, tables, kv_lens = np.zeros(sb + 1, np.int32), np.zeros((sb, width), np.int32), np.zeros(sb, np.int32)
        columns: dict[str, Any] = dict(
            input_ids=np.zeros(tb, np.int32),
            prev_index=np.full(tb, -1, np.int32),
            positions=np.zeros(tb, np.int32),
            slot_mapping=np.full(tb, -1, np.int32),
            block_tables=tables,
            cu_q_lens=cu,
            kv_lens=kv_lens,
            logits_indices=np.zeros(sb, np.int32),
            prompt_targets=np.full(tb, -1, np.int32) if num_steps == 1 else None,
        )
        inputs = StepInputs(**columns, **self._work_tiles(cu, tables, kv_lens, tb, q))
        empty = np.zeros(0, np.int32)
        sched = SchedulerOutput([], empty, empty, empty, empty, num_steps=num_steps)
        budget = np.zeros(sb, np.int32) if num_steps > 1 else None
        return StepBatch(sched, inputs, self.slots.sampling(empty, sb, empty), q, budget)

    def warmup(self) -> None:
        """Compile every step shape (`shapes()`), the resampler per sequence bucket and, with
        num_scheduler_steps > 1, the decode loop per decode shape."""
        jobs = [self.dummy(*shape) for shape in self.shapes()]
        if self.num_scheduler_steps > 1:
            jobs += [
                self.dummy(sb, sb, w, 1, self.num_scheduler_steps)
                for sb in self.seq_buckets
                for w in self.width_buckets
            ]
        for sb in self.seq_buckets:
            batch = self.dummy(sb, sb, self.width_buckets[0], 1)
            batch.history = self._history([], sb)
            jobs.append(batch)
        k = self.num_speculative_tokens
        for tb, sb, w, q in self.shapes() if k else ():
            if q > 1:  # a verify step carries k + 1 tokens a row: never a decode-only batch
                batch = self.dummy(tb, sb, w, q)
                batch.spec = verify_arrays(np.zeros((0, k), np.int32), np.zeros(0, np.int32), sb)
                jobs.append(batch)
        for batch in tqdm(jobs, desc="compiling step shapes", unit="shape", leave=False):
            self.dispatch(batch)
        jax.block_until_ready(self.kv_cache)
        self.prev_tokens, self.prev_rows = self._no_prev, {}
