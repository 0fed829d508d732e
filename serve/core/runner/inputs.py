"""Step inputs: the scheduler's output turned into the padded numpy arrays one device step reads."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jaxtyping import Array, Int

from pallas_kernels import tile_plan
from pallas_kernels.paged_tiles import TilePlan, kernel_work_list
from pallas_kernels.ragged_paged_attention import kernel_tile_tokens
from pallas_kernels.ragged_paged_attention_xla import tile_tokens
from serve.core.runner.batch import SlotTable
from serve.core.runner.ready_shapes import ReadyShapes, Shape
from serve.core.runner.sizing import fit
from serve.core.sampler import SamplingTensors
from serve.core.sequence import Sequence
from serve.core.spec_decode.verify_batch import verify_arrays
from serve.core.step_data import SchedulerOutput

if TYPE_CHECKING:  # serve.core.layout imports this package (its sizing)
    from serve.core.layout import CoreLayout


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
    lora_slots: Int[Array, " T"] | None = None  # multi-LoRA: each token's adapter slot (-1: none)


@dataclasses.dataclass
class StepBatch:
    """One device step, prepared on the host: the scheduler's output and the arrays to send."""

    sched: SchedulerOutput
    inputs: StepInputs
    sampling: SamplingTensors
    max_q_len: int
    budgets: np.ndarray | None = None  # decode loop: [sb] steps each row runs (padding rows 0): sched.budgets, padded
    history: tuple[np.ndarray, np.ndarray] | None = None  # resampling: [S, L] ids and is-output flags
    prompt_logprobs: bool = False
    grammar_rows: list[tuple[Any, int]] = dataclasses.field(default_factory=list)  # (matcher, row) to mask
    bias: tuple[np.ndarray, np.ndarray] | None = None  # resampling: logit_bias [S, MAX_LOGIT_BIAS] ids, values
    spec: tuple[np.ndarray, np.ndarray] | None = None  # verify step: drafts [S, k], target logit indices [S, k+1]
    rows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))  # each row's slot


@dataclasses.dataclass
class InputBuilder:
    """Builds a StepBatch from a SchedulerOutput over the persistent batch (`slots`), padded to the
    step's buckets: decode-only batches to a sequence bucket, batches with a prompt chunk to a token
    bucket and a (coarser) row bucket; block tables to a width bucket."""

    slots: SlotTable
    layout: CoreLayout  # its lengths, block size, buckets and attention implementation
    kernel_shape: tuple[int, int, bool]  # the Pallas kernel's (query heads per KV head, head dim, quantized KV)
    verify_min_rows: int = 1  # a verify step's rows are padded to at least this many
    ready: ReadyShapes = dataclasses.field(default_factory=ReadyShapes)  # what a batch may pad to during warm-up
    # multi-LoRA: each sequence's adapter slot, its adapter brought onto the device (None: LoRA off)
    adapter_slots: Callable[[list[Sequence]], np.ndarray] | None = None
    prev_row: np.ndarray = dataclasses.field(init=False)  # per slot: its row in the last dispatched step

    def __post_init__(self) -> None:
        self.prev_row = np.zeros(len(self.slots.num_blocks), np.int32)

    def dispatched(self, batch: StepBatch) -> None:
        """Record where each of the batch's sequences finds its last token in the step's output."""
        self.prev_row[batch.rows] = np.arange(len(batch.rows), dtype=np.int32)

    def prepare(self, sched: SchedulerOutput) -> StepBatch:
        """Host arrays for one step (or a multi-step decode loop). Python touches only the rows that
        changed (new sequences, grown block tables, tokens not fed from the device); the rest is
        numpy over the persistent batch."""
        table, lay = self.slots, self.layout
        seqs, num_steps = sched.seqs, sched.num_steps
        n_seq = len(seqs)
        rows = table.rows(seqs)
        counts, starts, pending, num_tokens = sched.num_new, sched.num_computed, sched.num_pending, sched.num_tokens
        n_tok = int(counts.sum())
        most = int(counts.max(initial=0))
        decode_only = most <= 1
        # Decodes: one token per sequence slot; verify steps of decodes only: k + 1 per slot; batches
        # with a prompt chunk: a token bucket and a row bucket.
        k1 = 1 + (sched.draft_ids.shape[1] if sched.draft_ids is not None else 0)
        per_row = 1 if decode_only else k1 if most <= k1 else 0
        padded_rows = min(max(n_seq, self.verify_min_rows), lay.seq_buckets[-1]) if per_row > 1 else n_seq
        sb = fit(padded_rows, lay.seq_buckets if per_row else lay.mixed_seq_buckets)
        tb = sb * per_row if per_row else fit(n_tok, lay.token_buckets)
        width = fit(int(table.num_blocks[rows].max()), lay.width_buckets)
        resample = sched.budgets is None and bool(table.resample[rows].any())
        if not self.ready.complete:  # warm-up still compiling: the smallest compiled shape that holds it
            kind = "loop" if sched.budgets is not None else "verify" if sched.draft_ids is not None else "step"
            need = Shape(kind, tb, sb, width, per_row or tb)
            _, tb, sb, width, _ = self.ready.pick(need, mixed=not per_row, resample=resample)
        cu = np.zeros(sb + 1, np.int32)
        np.cumsum(counts, out=cu[1 : n_seq + 1])
        cu[n_seq + 1 :] = cu[n_seq]
        seq_of_tok = np.repeat(np.arange(n_seq), counts)
        positions = np.zeros(tb, np.int32)
        positions[:n_tok] = starts[seq_of_tok] + np.arange(n_tok) - cu[seq_of_tok]
        block_tables = np.zeros((sb, width), np.int32)
        block_tables[:n_seq] = table.blocks[rows, :width]
        input_ids = np.zeros(tb, np.int32)
        prev_index = np.full(tb, -1, np.int32)
        if decode_only:  # each sequence feeds its last token, or the one still on the device
            has_prev = pending > 0
            known = np.flatnonzero(~has_prev).tolist()
            input_ids[known] = [seqs[i].tokens[-1] for i in known]
            prev_index[:n_seq][has_prev] = self.prev_row[rows[has_prev]]
        else:
            drafts = sched.draft_ids
            for i, (s, n, start) in enumerate(zip(seqs, counts.tolist(), starts.tolist())):
                row = s.tokens[start : start + n]  # the row's tokens, then its drafts (never the whole history)
                if drafts is not None and len(row) < n:
                    past = start - len(s.tokens)
                    row += [t for t in drafts[i].tolist() if t >= 0][max(past, 0) : past + n]
                if len(row) == n:
                    input_ids[cu[i] : cu[i] + n] = row
                else:  # a decode of the token the previous step is still sampling on the device
                    prev_index[cu[i]] = self.prev_row[rows[i]]
        slots = np.full(tb, -1, np.int32)
        p = positions[:n_tok]
        bs = lay.block_size
        slots[:n_tok] = block_tables[seq_of_tok, p // bs] * bs + p % bs
        kv_lens = np.zeros(sb, np.int32)
        kv_lens[:n_seq] = starts + counts
        logits_indices = np.zeros(sb, np.int32)
        logits_indices[:n_seq] = cu[1 : n_seq + 1] - 1
        out_pos = num_tokens - table.prompt_len[rows]
        max_q_len = per_row or tb
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
        budgets, plan_kv = None, kv_lens
        if sched.budgets is not None:
            budgets = np.zeros(sb, np.int32)
            budgets[:n_seq] = sched.budgets
            plan_kv = kv_lens + np.maximum(budgets - 1, 0)  # pages up to the last token the loop may write
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
        if self.adapter_slots is not None:
            columns["lora_slots"] = np.full(tb, -1, np.int32)
            columns["lora_slots"][:n_tok] = self.adapter_slots(seqs)[seq_of_tok]
        inputs = StepInputs(**columns, **self.work_tiles(cu, block_tables, plan_kv, tb, max_q_len))
        sampling = table.sampling(rows, sb, out_pos)
        batch = StepBatch(sched, inputs, sampling, max_q_len, budgets, prompt_logprobs=prompt_logprobs, rows=rows)
        if sched.draft_ids is not None:
            batch.spec = verify_arrays(sched.draft_ids, logits_indices[:n_seq], sb)
        if resample:
            batch.history = self.history(seqs, sb)
            batch.bias = table.bias(rows, sb)
            samples = sched.samples
            batch.grammar_rows = [(s.matcher, i) for i, s in enumerate(seqs) if s.matcher is not None and samples[i]]
        return batch

    def work_tiles(
        self, cu: np.ndarray, block_tables: np.ndarray, kv_lens: np.ndarray, tb: int, max_q_len: int
    ) -> dict[str, Any]:
        """The attention's work tiles, built here on the host: a tile plan (XLA) or a work list (Pallas)."""
        if self.layout.attn_impl == "xla":
            tokens = tile_tokens(max_q_len, tb)
            return {"plan": tile_plan(cu, kv_lens, block_tables, self.layout.block_size, tb, tokens, np)}
        if self.layout.attn_impl == "pallas":
            group, head_dim, quantized = self.kernel_shape
            tokens = kernel_tile_tokens(group, head_dim, max_q_len, quantized)
            return {"work": kernel_work_list(cu, tb, tokens, np)}
        return {}

    def history(self, seqs: list[Sequence], sb: int) -> tuple[np.ndarray, np.ndarray]:
        """Resampling's token history [sb, max_model_len] (-1 pads) and which of it is output."""
        history = np.full((sb, self.layout.max_model_len), -1, np.int32)
        is_out = np.zeros((sb, self.layout.max_model_len), bool)
        for i, s in enumerate(seqs):
            history[i, : len(s.tokens)] = s.tokens
            is_out[i, s.prompt_len : len(s.tokens)] = True
        return history, is_out

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
            lora_slots=np.full(tb, -1, np.int32) if self.adapter_slots is not None else None,
        )
        inputs = StepInputs(**columns, **self.work_tiles(cu, tables, kv_lens, tb, q))
        empty = np.zeros(0, np.int32)
        # may_draft: warm-up compiles a device proposer's steps too
        sched = SchedulerOutput([], empty, empty, empty, empty, num_steps=num_steps, may_draft=True)
        budgets = np.zeros(sb, np.int32) if num_steps > 1 else None
        return StepBatch(sched, inputs, self.slots.sampling(empty, sb, empty), q, budgets)
