"""ModelRunner: places the weights and KV pools, turns each SchedulerOutput into a step batch and
dispatches the jitted device step; compiles every step shape at warm-up (serve.core.runner.warmup).

Steps are dispatched asynchronously: `dispatch` returns at once and `InFlight.fetch` waits; a
decode whose previous token is still on the device reads it there. A decode-only batch may run
`num_steps` decode steps inside one jitted loop. Penalties and structured-output masks resample the
step's logits in a second jitted call; the host fills the masks while the first call runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh

from jaxinfra.models import LlamaModel
from jaxinfra.models.llama import layer_graph, stack_layers, unstack_layers
from pallas_kernels import PagedKVCache
from pallas_kernels.kv_quant import is_quantized_kv
from serve.config import kv_storage_dtype
from serve.core.host_transfer import Layout, pack
from serve.core.lora import AdapterSlots
from serve.core.runner.batch import SlotTable
from serve.core.runner.compile_pool import CompilePool
from serve.core.runner.device_step import DeviceStep, LoopTap
from serve.core.runner.inflight import InFlight
from serve.core.runner.inputs import InputBuilder, StepBatch
from serve.core.runner.ready_shapes import ReadyShapes
from serve.core.runner.sizing import fit
from serve.core.runner.warmup import warm_up
from serve.core.runner.weight_sync import engine_layout, place_like
from serve.core.step_data import SchedulerOutput
from serve.core.structured_output import GrammarCompiler, bitmask_words
from sharding import get_rules, named_sharding, shard_state, tensor_parallel_mesh

if TYPE_CHECKING:  # serve.core.layout imports this package (its sizing)
    from serve.core.layout import CoreLayout
    from serve.core.spec_decode.proposer import DeviceProposer, Proposer


def device_step(
    model: LlamaModel,
    graphdef: nnx.GraphDef,
    state: nnx.State,
    layout: CoreLayout,
    mesh: Any = None,
    activation_rules: Any = None,
    loop_tap: LoopTap | None = None,
    return_hidden: bool = False,
    lora_def: Any = None,
) -> tuple[DeviceStep, list]:
    """The jitted steps' closure for `model` (split into graphdef and placed `state`) and its weights;
    with `layout.scan_layers`, identical layers' weights are stacked once here and scanned in every step.
    `lora_def`: multi-LoRA's pools' structure (their leaves follow the weights in each step's call)."""
    params = nnx.to_pure_dict(state)
    template = abstract(nnx.to_flat_state(state))  # shapes only: the weights' one copy is `weights`
    stacked: tuple[nnx.GraphDef, list] | None = None
    if layout.scan_layers:
        try:
            graph, layer_template = layer_graph(model.layers)
            stacked = graph, abstract(layer_template)
            params = stack_layers(params)
        except ValueError:  # layers that differ (e.g. partly quantized) run one after the other
            stacked = None
    # The weights travel as a flat list: flattening a pytree of them on every call costs more than the step.
    weights, state_def = jax.tree.flatten(params)
    parts = (model.cfg, graphdef, template, stacked, state_def, mesh, activation_rules, layout, loop_tap, return_hidden)
    return DeviceStep(*parts, lora_def), weights


def abstract(flat: Any) -> list:
    """(path, variable) pairs with each value a ShapeDtypeStruct: a template for merge_params that
    keeps no array alive."""
    return [(p, v.replace(value=jax.ShapeDtypeStruct(v[...].shape, v[...].dtype))) for p, v in flat]


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        layout: CoreLayout,
        *,
        proposer: Proposer | None = None,
        loop_tap: Callable[[Mesh | None], LoopTap] | None = None,
        grammar: Callable[[], GrammarCompiler] | None = None,
    ) -> None:
        """`layout.num_speculative_tokens` (k > 0): verify steps, k drafts a row, are compiled at warm-up;
        `proposer`: speculative decoding's (spec_decode.proposer); one that drafts on device is placed
        here, on its own KV pool;
        `loop_tap`: makes decode loops' tap for the mesh (serve.core.loop_stream); `grammar`: the
        structured-output compiler that fills token masks (built with the first request that needs one)."""
        cfg = model.cfg
        self.cfg = cfg
        self.layout = layout
        self.grammar = grammar
        graphdef, state = nnx.split(model)
        self.attn_impl = layout.attn_impl
        # One pool for every layer, stacked on a leading layers axis: the layers run as one scan.
        self.kv_cache = PagedKVCache.zeros(
            layout.num_blocks,
            layout.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_storage_dtype(layout.kv_cache_dtype, cfg.dtype),
            num_layers=cfg.num_layers,
        )
        # expert_parallel_size > 1: an MoE model's experts split whole over that many devices (tp_ep);
        # context_parallel_size > 1: each step's tokens split over that many (the rules' `length`)
        tp, ep, cp = layout.tensor_parallel_size, layout.expert_parallel_size, layout.context_parallel_size
        rules = get_rules("tp_ep" if ep > 1 else "tp")
        mesh = None
        if max(tp, ep, cp) > 1:  # weights and KV pools split over KV heads (replicated over context)
            mesh = tensor_parallel_mesh(tp, cfg.num_kv_heads, ep, cp)
            state = shard_state(state, mesh, rules.params)
            axes = (None, None, None, "kv_heads", "head_dim")
            self.kv_cache = jax.tree.map(
                lambda a: jax.device_put(a, named_sharding(axes[: a.ndim], rules.params, a.shape, mesh)),
                self.kv_cache,
            )
        tap = loop_tap(mesh) if loop_tap is not None else None
        hidden = proposer is not None and proposer.target_hidden
        # multi-LoRA: adapter slots on the device, passed to each step after the weights
        self.lora = (
            AdapterSlots(cfg, layout.max_loras, layout.max_lora_rank, layout.max_cpu_loras, layout.lora_target_modules)
            if layout.max_loras
            else None
        )
        lora_def = jax.tree.structure(self.lora.pools) if self.lora is not None else None
        self.device, self.weights = device_step(
            model, graphdef, state, layout, mesh, rules.activations, tap, return_hidden=hidden, lora_def=lora_def
        )
        self.layer_graph = self.device.layer_graph
        self._template = abstract(nnx.to_flat_state(state))
        # a proposer model's step closure: no eos (it drafts greedily, the target's sampler stops)
        step_of = lambda m: device_step(m, *nnx.split(m), dataclasses.replace(layout, eos_token_ids=()))
        self.proposer: DeviceProposer | None = None
        if proposer is not None and proposer.device is not None:
            self.proposer = proposer.device(
                self.device, step_of, layout.num_blocks, layout.kv_cache_dtype, layout.max_model_len
            )
        self.slots = SlotTable(2 * layout.max_num_seqs, layout.max_blocks, cfg.vocab_size)
        self.ready = ReadyShapes()  # the compiled shapes batches pad to while warm-up runs
        self.compile_pool: CompilePool | None = None
        pool = self.kv_cache.k
        self.inputs = InputBuilder(
            self.slots,
            layout,
            (cfg.num_heads // cfg.num_kv_heads, pool.shape[-1], is_quantized_kv(pool.dtype)),
            self.proposer.verify_min_rows if self.proposer is not None else 1,
            self.ready,
            self.lora.slots if self.lora is not None else None,
        )
        self._no_prev = jnp.zeros((layout.max_num_seqs,), jnp.int32)
        if mesh is not None:  # placed as the steps place their sampled tokens, so the first step's call is theirs
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self._no_prev = jax.device_put(self._no_prev, replicated)
        self.prev_tokens = self._no_prev  # the last single step's sampled tokens, on device
        d = self.device
        self._step = jax.jit(d.step, donate_argnums=(1,), static_argnames=("layout", "max_q_len"))
        self._multi = jax.jit(d.multi, donate_argnums=(1,), static_argnames=("layout", "num_steps"))
        self._resample = jax.jit(d.resample, static_argnames=("layout",))
        self._verify = jax.jit(d.verify, donate_argnums=(1,), static_argnames=("layout", "max_q_len"))

    @property
    def step_weights(self) -> list:
        """What each step takes as its weights: the model's, then with LoRA the adapter pools' leaves."""
        return self.weights if self.lora is None else self.weights + jax.tree.leaves(self.lora.pools)

    @property
    def num_compilations(self) -> int:
        """Step shapes compiled so far (warm-up's, and any after it: there should be none)."""
        return self.device.num_compilations + (self.proposer.num_compilations if self.proposer is not None else 0)

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
        return self.inputs.prepare(sched)

    @staticmethod
    def _loop_buffers(batch: StepBatch) -> tuple[dict[str, np.ndarray], Layout]:
        """A decode loop's packed inputs: the step's, each row's budget and the step id."""
        return pack((batch.inputs, batch.sampling, batch.budgets, np.array([batch.sched.step_id], np.int32)))

    def dispatch(self, batch: StepBatch) -> InFlight:
        """Start the step on the device; returns at once (JAX dispatches asynchronously): a decode loop,
        or its packed inputs, the proposer's work before, the step or verify step, and its work after."""
        if batch.budgets is not None:
            return self._loop(batch)
        buffers, layout = pack((batch.inputs, batch.sampling, *(batch.spec or ())))
        prev, proposer = self.prev_tokens, self.proposer
        if proposer is not None:
            buffers = proposer.before_step(batch, buffers, layout, prev)
        step = self._single if batch.spec is None else self._verify_step
        flight, hidden = step(batch, buffers, layout)
        self.inputs.dispatched(batch)
        if proposer is not None:
            proposer.after_step(flight, self.weights, hidden, buffers, layout, prev, self.prev_tokens)
        return flight

    def _loop(self, batch: StepBatch) -> InFlight:
        """A decode loop of num_steps steps in one call."""
        buffers, layout = self._loop_buffers(batch)
        out, self.prev_tokens, self.kv_cache, load, _ = self._multi(  # _: the loop tap's receipt
            self.step_weights, self.kv_cache, buffers, self.prev_tokens, layout=layout, num_steps=batch.sched.num_steps
        )
        self.inputs.dispatched(batch)
        return InFlight(batch, out, (), expert_counts=load)

    def _verify_step(self, batch: StepBatch, buffers: Any, layout: Layout) -> tuple[InFlight, list]:
        """A speculative verify step (the proposer's, when it drafts on device) and its hidden states."""
        args, q = (self.step_weights, self.kv_cache, buffers, self.prev_tokens), batch.max_q_len
        if self.proposer is None:
            verified = self._verify(*args, None, layout=layout, max_q_len=q)
        else:
            verified = self.proposer.verify(self._verify, *args, layout=layout, max_q_len=q)
        out, num_emitted, self.prev_tokens, self.kv_cache, load, *h = verified
        return InFlight(batch, out, (), num_emitted, load), h

    def _single(self, batch: StepBatch, buffers: Any, layout: Layout) -> tuple[InFlight, list]:
        """One step, its logits resampled for penalties, logit_bias or grammars; and its hidden states."""
        out, padded, logits, prompt, self.kv_cache, load, *h = self._step(
            self.step_weights, self.kv_cache, buffers, self.prev_tokens, layout=layout, max_q_len=batch.max_q_len
        )
        if batch.history is not None:
            sb = batch.history[0].shape[0]
            bitmask = np.full((sb, bitmask_words(self.cfg.vocab_size)), -1, np.int32)
            if batch.grammar_rows:
                assert self.grammar is not None
                self.grammar().fill(batch.grammar_rows, bitmask)  # while the forward pass runs
            bias = batch.bias or self.slots.bias(np.zeros(0, np.int32), sb)
            extra, extra_layout = pack((batch.sampling, *batch.history, bitmask, *bias))
            out, padded = self._resample(logits, extra, layout=extra_layout)
        self.prev_tokens = padded
        return InFlight(batch, out, prompt, expert_counts=load), h

    def compiled_text(self, batch: StepBatch) -> str:
        """The optimised HLO a batch of this shape runs (for checks such as "no KV pool is copied")."""
        if batch.budgets is not None:
            buffers, layout = self._loop_buffers(batch)
            lowered = self._multi.lower(
                self.step_weights,
                self.kv_cache,
                buffers,
                self.prev_tokens,
                layout=layout,
                num_steps=batch.sched.num_steps,
            )
        else:
            buffers, layout = pack((batch.inputs, batch.sampling))
            lowered = self._step.lower(
                self.step_weights, self.kv_cache, buffers, self.prev_tokens, layout=layout, max_q_len=batch.max_q_len
            )
        return lowered.compile().as_text() or ""

    # --- warm-up ----------------------------------------------------------------------------------
    def shapes(self) -> list[tuple[int, int, int, int]]:
        """Every (tokens, sequences, block-table width, max_q_len) a step can have: decode-only
        batches (one token per sequence bucket slot) and batches with a prompt chunk (a token bucket,
        and a row bucket up to the one holding as many rows as it has tokens)."""
        lay = self.layout
        decode = [(sb, sb, w, 1) for sb in lay.seq_buckets for w in lay.width_buckets]
        mixed = [
            (tb, sb, w, tb)
            for tb in lay.token_buckets
            for sb in lay.mixed_seq_buckets
            if sb <= fit(min(tb, lay.max_num_seqs), lay.mixed_seq_buckets)
            for w in lay.width_buckets
        ]
        return decode + mixed

    def verify_shapes(self) -> list[tuple[int, int, int, int]]:
        """Every shape a speculative verify step can have (none without speculation): the mixed shapes
        (never a decode-only batch: a row with drafts brings up to k + 1 tokens), and k + 1 tokens per
        sequence bucket slot when every row brings at most that many."""
        lay = self.layout
        k1 = lay.num_speculative_tokens + 1
        if k1 == 1:
            return []
        rows = [sb for sb in lay.seq_buckets if sb >= min(self.inputs.verify_min_rows, lay.seq_buckets[-1])]
        per_row = [(sb * k1, sb, w, k1) for sb in rows for w in lay.width_buckets]
        return [shape for shape in self.shapes() if shape[3] > 1] + per_row

    def params(self) -> dict:
        """The model's weights as a pure dict, one entry per layer (views of the steps' weights,
        which hold the only copy)."""
        params = jax.tree.unflatten(self.device.state_def, self.weights)
        return unstack_layers(params, self.cfg.num_layers) if self.layer_graph is not None else params

    @property
    def state(self) -> nnx.State:
        """The model's variables (for inspection: names, values, shardings), rebuilt from the weights."""
        flat = traverse_util.flatten_dict(self.params())
        return nnx.from_flat_state([(p, v.replace(value=flat[p])) for p, v in self._template])

    def update_weights(self, source: Any) -> None:
        """Replace the model's weights in place from a model, state, TrainState or params dict: same
        names and shapes, cast and placed as the engine's, so no step recompiles."""
        old = jax.tree.unflatten(self.device.state_def, self.weights)
        self.weights = jax.tree.leaves(place_like(engine_layout(source, old, self.cfg.num_layers), old))

    def dummy(self, tb: int, sb: int, width: int, q: int, num_steps: int = 1) -> StepBatch:
        """An empty batch of the given shape (what warm-up compiles)."""
        return self.inputs.dummy(tb, sb, width, q, num_steps)

    def warmup(self, background: bool = False, threads: int = 0) -> None:
        """Compile every step shape (`shapes()`), the resampler per sequence bucket, with
        num_scheduler_steps > 1 the decode loop per decode shape, and the verify shapes, on `threads`
        threads (0: one per core, up to 8). With `background`, return once the largest shape of each
        kind is compiled: batches pad to compiled shapes while the rest compile (`wait_compiled`)."""
        self.compile_pool = warm_up(self, background, threads)

    def wait_compiled(self) -> None:
        """Block until warm-up has compiled every shape (at once without a background warm-up)."""
        if self.compile_pool is not None:
            self.compile_pool.wait()

    @property
    def shapes_compiled(self) -> tuple[int, int]:
        """(compiled, total) step shapes of the last warm-up ((0, 0) before one, or for one by dispatch)."""
        pool = self.compile_pool
        return (0, 0) if pool is None else (len(self.ready), pool.total)
