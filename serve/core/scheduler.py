"""Continuous-batching scheduler with chunked prefill and recompute preemption (vLLM V1 style).

It owns request state: `schedule()` decides what each sequence computes next and hands the runner
plain data (`SchedulerOutput`); `update_from_output()` is the one place where a step's results
change that state (tokens appended, stop rules, counters, prefix-cache keys, finishing and freeing).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from serve.core.decode_loop import loop_steps
from serve.core.kv_cache import BlockManager
from serve.core.layout import CoreLayout
from serve.core.prefill_budget import PrefillBudget, held_for, pairs, tokens_within
from serve.core.request_state import CoreRequest, Logprob, collect_prompt_logprobs, token_logprobs
from serve.core.scheduling_policy import POLICIES
from serve.core.sequence import Sequence, Status
from serve.core.spec_decode.scheduling import SpecScheduling
from serve.core.step_data import SchedulerOutput, StepResult
from serve.kv_transfer.base import KVConnectorBase
from serve.kv_transfer.remote_loads import RemoteLoads
from serve.types import EngineCoreOutput

if TYPE_CHECKING:
    from serve.core.spec_decode.proposer import HostProposer


class Scheduler:
    """Each step spends `max_num_batched_tokens` over at most `max_num_seqs` sequences: running ones
    first (decodes and unfinished prompt chunks), then waiting prompts, except that a long prompt's
    chunk leaves room for a waiting prompt that fits the step's prompt cap whole. When blocks run out,
    the policy's choice of running sequence is preempted (blocks freed, recomputed later): the newest
    under fcfs, the least urgent under priority, the most-served tenant's under fair
    (serve.core.scheduling_policy, which also orders the waiting queue).

    Asynchronous scheduling: a running sequence whose last sampled token is still on the device is
    scheduled for it (the runner feeds it from the device); a waiting one is not admitted until its
    tokens are known, and one that has reached max_tokens is not scheduled again. A decode-only batch
    that no waiting sequence could join (none waits, or every row is taken) runs `num_scheduler_steps`
    steps in one jitted loop. With `stream_loops` a loop's tokens reach streams as they are made
    (serve.core.loop_stream), so streams may loop too; otherwise a stream's rows run single steps."""

    def __init__(
        self,
        block_manager: BlockManager,
        layout: CoreLayout,
        *,
        proposer: HostProposer | None = None,
        connector: KVConnectorBase | None = None,
        stream_loops: bool = False,
    ) -> None:
        """`proposer`: speculative decoding's, drafting for decodes while at most
        `layout.disable_spec_above` sequences run (None: always). `connector`: disaggregation's KV
        connector (scheduler side). `stream_loops`: see the class docstring."""
        self.bm = block_manager
        self.layout = layout
        self.max_num_seqs = layout.max_num_seqs
        self.max_num_batched_tokens = budget = layout.max_num_batched_tokens
        self.enable_chunked_prefill = layout.enable_chunked_prefill
        self.policy = POLICIES[layout.scheduling_policy]()
        self.max_model_len = layout.max_model_len
        self.eos_set = frozenset(layout.eos_token_ids)
        per_decode = layout.prefill_tokens_per_decode if layout.enable_chunked_prefill else 0
        # a capped prefill fills its bucket, and its chunks' attention is capped with it
        self.prefill = PrefillBudget(budget, per_decode, layout.token_buckets, layout.pairs_per_token)
        self.stream_loops = stream_loops
        self.num_steps_made = 0
        self.spec = (
            None if proposer is None else SpecScheduling(proposer, layout.disable_spec_above, layout.max_model_len)
        )
        self.connector = connector
        self.remote = None if connector is None else RemoteLoads(connector, block_manager)
        self.waiting = self.policy  # the waiting queue, in the policy's order
        self.running: list[Sequence] = []
        self.requests: dict[str, CoreRequest] = {}
        self.host_bound: set[str] = set()  # requests with penalties or a grammar (`needs_sync`)
        self.finished_ids: list[int] = []  # left the batch since the last schedule()
        self.num_preemptions = 0
        self.now = 0.0  # set by the engine before each schedule(): first-scheduled times

    # --- requests ---------------------------------------------------------------------------------
    def add_request(self, req: CoreRequest) -> None:
        rid = req.request.request_id
        self.requests[rid] = req
        if any(s.params.uses_penalties or s.matcher is not None for s in req.seqs):
            self.host_bound.add(rid)
        self.add(req.seqs[0])

    def _forget(self, rid: str) -> None:
        """A finished request leaves the scheduler."""
        del self.requests[rid]
        self.host_bound.discard(rid)

    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = Status.WAITING
        self.waiting.add(seq, front)

    def abort(self, rid: str, index: int = -1) -> None:
        """Stop a request (index -1) or one of its sequences now and free its blocks."""
        req = self.requests.get(rid)
        if req is None:
            return
        for seq in req.seqs if index < 0 else req.seqs[index : index + 1]:
            if seq in req.pending:
                req.pending.remove(seq)
                seq.status = Status.FINISHED
            elif not seq.is_finished:
                self.remove(seq)
            seq.finish_reason = seq.finish_reason or "abort"
        if req.finished:
            self._forget(rid)

    def remove(self, seq: Sequence) -> dict[str, Any] | None:
        """Drop a sequence (finished or aborted) and free its blocks; the runner frees its row at the
        next step. Returns the KV connector's kv_transfer_params for the client (blocks it offers)."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING and not (self.remote is not None and self.remote.drop(seq)):
            self.waiting.remove(seq)
        params = self.connector.request_finished(seq, seq.block_ids)[1] if self.connector is not None else None
        self.bm.free(seq)
        seq.status = Status.FINISHED
        self.finished_ids.append(seq.seq_id)
        return params

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        self.num_preemptions += 1
        self.add(seq, front=True)

    def needs_sync(self) -> bool:
        """A running sequence whose last token is still on the device needs it on the host before it is
        scheduled: penalties read the host-built history, a structured output its matcher."""
        if self.spec is not None and self.spec.needs_sync(len(self.running)):
            return any(s.num_pending for s in self.running)
        if not self.host_bound:
            return False
        return any(s.num_pending and (s.params.uses_penalties or s.matcher is not None) for s in self.running)

    # --- scheduling -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        bs = self.bm.block_size
        running = self.running
        spec = self.spec
        drafts = spec.propose(self.running, self.waiting, self.budget) if spec is not None else {}
        allocate = self.bm.allocate_slots
        prefill = self.prefill.cap(len(running))
        pair_left = self.prefill.pair_cap(len(running))
        starved = False  # a prompt chunk got no token for want of pairs
        held: tuple[int, int] | None = None  # (tokens, pairs) left to a short waiting prompt, once asked
        i = 0
        while i < len(running) and budget > 0:  # the hot loop at large batches: kept to plain reads
            seq = running[i]
            computed = seq.num_computed_tokens
            total = len(seq.tokens) + seq.num_pending
            n = total - computed
            chunk = n > 1  # a prompt chunk (or a preempted sequence's recompute)
            if chunk:  # within the step's prompt tokens and pairs, less what a short waiting prompt needs
                if n > prefill and held is None:  # this prompt cannot finish in this step
                    held = held_for(self._joinable_head(), prefill)
                hold_tokens, hold_pairs = held if n > prefill and held else (0, 0)
                room = max(prefill - hold_tokens, 0)  # chunks that finish this step may have taken some
                n = tokens_within(computed, min(n, room), max(pair_left - hold_pairs, 0))
                starved = starved or n == 0 < room
            elif drafts:
                extra = len(drafts.get(seq.seq_id, ()))
                total += extra
                n += extra
            if n > budget:
                n = budget
            if n <= 0 or total - seq.prompt_len >= seq.max_tokens:
                i += 1  # nothing to compute, or max_tokens already in flight
                continue
            slots = n if spec is None else n + spec.lookahead(seq, n)
            grows = computed + slots > len(seq.block_ids) * bs
            while grows and not allocate(seq, slots):
                victim = running.pop(self.policy.victim(running, i))
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                if chunk:
                    prefill -= n
                    pair_left -= pairs(computed, n)
                i += 1
        budget = min(budget, self.prefill.fill(self.max_num_batched_tokens - budget, prefill))
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.head() if self.remote is None else self.remote.next_waiting(self.waiting)
            if seq.num_pending:
                break  # its last token is still on the device
            if self._no_adapter_slot(seq):
                break  # every adapter slot is taken by running sequences of other adapters
            if not seq.block_ids:
                seq.num_computed_tokens = seq.num_cached_tokens = self.bm.allocate_prefix(seq)
                if self.remote is not None and self.remote.start(seq, self.waiting):
                    continue
            start = seq.num_computed_tokens
            remaining = seq.num_tokens - start
            n = tokens_within(start, min(remaining, budget), pair_left)
            starved = starved or n == 0
            # Without chunking a prompt waits for a step with room for all of it (the budget holds
            # max_model_len); and for blocks when the pool is short.
            fits = n > 0 and (n == remaining or self.enable_chunked_prefill)
            if not fits or not self.bm.allocate_slots(seq, n + self._lookahead(seq, n)):
                self.bm.free(seq)
                break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.policy.place(self.running, seq)
            scheduled.append((seq, n))
            budget -= n
            pair_left -= pairs(start, n)
        self.prefill.settle(pair_left, starved)
        return self._output(scheduled, preempted, drafts)

    def _joinable_head(self) -> Sequence | None:
        """The waiting queue's head if it could join the running batch in this step."""
        joinable = bool(self.waiting) and len(self.running) < self.max_num_seqs and self.remote is None
        seq = self.waiting.head() if joinable else None
        return None if seq is None or self._no_adapter_slot(seq) else seq

    def _no_adapter_slot(self, seq: Sequence) -> bool:
        """Whether admitting `seq` would run more LoRA adapters at once than the device has slots."""
        if not seq.lora_id:
            return False
        adapters = {s.lora_id for s in self.running if s.lora_id}
        return seq.lora_id not in adapters and len(adapters) >= self.layout.max_loras

    def finish_loads(self, loaded: set[str], failed: set[str]) -> None:
        """The worker loaded (or failed to load) these requests' remote KV: back to the front of the queue."""
        assert self.remote is not None
        for seq in self.remote.finish(loaded, failed):
            self.add(seq, front=True)

    def _lookahead(self, seq: Sequence, n: int) -> int:
        """KV slots past a step's `n` tokens that the proposer writes (EAGLE's drafts)."""
        return self.spec.lookahead(seq, n) if self.spec is not None else 0

    def budget(self, seq: Sequence) -> int:
        """Tokens a sequence may still produce: up to max_tokens and max_model_len."""
        return max(min(self.max_model_len - seq.num_tokens, seq.max_tokens - seq.num_output_tokens), 0)

    def _output(
        self, scheduled: list[tuple[Sequence, int]], preempted: list[Sequence], drafts: dict[int, list[int]]
    ) -> SchedulerOutput:
        """The step as data, then the state it implies: computed and pending counts advanced (a loop's
        rows by their whole budgets), and the blocks the step fills keyed for the prefix cache (any
        step that reads them runs after it)."""
        n = len(scheduled)
        seqs = [s for s, _ in scheduled]
        k = self.layout.num_scheduler_steps
        admissible = bool(self.waiting) and len(self.running) < self.max_num_seqs
        num_steps = loop_steps(scheduled, k, admissible, self.stream_loops, self.bm, self.budget)
        rows = [(c, s.num_computed_tokens, len(s.tokens), s.num_pending) for s, c in scheduled]
        num_new, num_computed, num_tokens, num_pending = np.array(rows, np.int32).reshape(n, 4).T.copy()
        num_tokens += num_pending  # those still on the device count
        sched = SchedulerOutput(
            seqs,
            num_new,
            num_computed,
            num_tokens,
            num_pending,
            preempted,
            self.finished_ids,
            num_steps,
            step_id=self.num_steps_made,
            draft_ids=self.spec.draft_ids(scheduled, drafts) if self.spec is not None else None,
            may_draft=self.spec is not None and self.spec.may_draft(len(self.running)),
        )
        if self.spec is not None:
            self.spec.before_step(sched)
        self.num_steps_made += n > 0  # empty outputs are not dispatched: the numbers stay contiguous
        self.finished_ids = []
        made = sched.samples.astype(np.int32)
        if num_steps > 1:
            made = np.minimum(np.fromiter((self.budget(s) for s in seqs), np.int32, n), num_steps)
            sched = dataclasses.replace(sched, budgets=made)
        bs = self.bm.block_size
        now = self.now
        computing = (sched.num_new if num_steps == 1 else made).tolist()
        self.policy.charge(seqs, computing)
        for seq, new, m in zip(seqs, computing, made.tolist()):
            if seq.first_scheduled is None:
                seq.first_scheduled = now
            computed = seq.num_computed_tokens = seq.num_computed_tokens + new
            seq.num_pending += m
            known = len(seq.tokens)
            if (computed if computed < known else known) >= (len(seq.block_hashes) + 1) * bs:
                self.bm.cache_full_blocks(seq)
        return sched

    # --- results ----------------------------------------------------------------------------------
    def update_from_output(
        self, sched: SchedulerOutput, res: StepResult, outputs: dict[Sequence, EngineCoreOutput]
    ) -> None:
        """Apply a step's results: each row's tokens appended and checked against the stop rules,
        its pending count settled, finished sequences freed; what each produced goes to `outputs`."""
        if res.prompt_logprobs is not None:
            collect_prompt_logprobs(sched.seqs, sched.num_computed, sched.num_new, res.prompt_logprobs)
        loop = sched.budgets is not None
        made = (sched.samples.astype(np.int32) if sched.budgets is None else sched.budgets).tolist()
        tokens = res.tokens.T.tolist() if loop else res.tokens.tolist()  # rows of tokens, or one token per row
        multi = loop or res.num_emitted is not None
        emitted = made
        if self.spec is not None:  # rejected drafts' KV is rolled back; EAGLE keeps what each row's next step verifies
            emitted = made if res.num_emitted is None else self.spec.settle(sched, res.num_emitted, made)
            self.spec.after_step(sched, res)
        bs = self.bm.block_size
        plain = res.logprobs is None
        eos, max_len, finished = self.eos_set, self.max_model_len, Status.FINISHED
        for i, (seq, m, row, e) in enumerate(zip(sched.seqs, made, tokens, emitted)):
            if seq.status is finished:
                continue
            seq.num_pending -= m
            known = seq.tokens
            for k in range(e):
                token = row[k] if multi else row
                # The common case inline (the loop runs per row per step): a started sequence without a
                # grammar takes a token that is no EOS or stop id and stays within max_tokens and
                # max_model_len. Anything else goes through `_append`'s full rules.
                n = len(known) + 1
                if (
                    plain
                    and seq.matcher is None
                    and seq.started
                    and token not in eos
                    and token not in seq.stop_ids
                    and n - seq.prompt_len < seq.max_tokens
                    and n < max_len
                ):
                    known.append(token)
                    out = outputs.get(seq)
                    if out is None:
                        outputs[seq] = EngineCoreOutput(seq.request_id, seq.index, [token])
                    else:
                        out.new_token_ids.append(token)
                    continue
                lp = None
                if res.logprobs is not None:
                    at = (k, i) if loop else (i,)
                    lp = (res.logprobs[0][at], res.logprobs[1][at], res.logprobs[2][at])
                if self._append(seq, token, lp, outputs):
                    break
            else:
                full = seq.num_computed_tokens if seq.num_computed_tokens < len(known) else len(known)
                if full >= (len(seq.block_hashes) + 1) * bs:
                    self.bm.cache_full_blocks(seq)

    def _append(self, seq: Sequence, token: int, lp: Logprob | None, outputs: dict[Sequence, EngineCoreOutput]) -> bool:
        """Add a sampled token and check the stop rules (EOS and stop ids once min_tokens are out,
        max_tokens, max_model_len, the grammar); True if the sequence finished."""
        seq.tokens.append(token)
        out = outputs.get(seq)
        if out is not None:
            out.new_token_ids.append(token)
        else:
            out = outputs[seq] = EngineCoreOutput(seq.request_id, seq.index, [token])
            if not seq.started:
                self._first_output(seq, out)
        if lp is not None and seq.params.logprobs is not None:
            out.new_logprobs = out.new_logprobs or []
            out.new_logprobs.append(token_logprobs(token, lp, seq.params.logprobs))
        grammar_error = grammar_done = False
        if seq.matcher is not None:  # the mask allowed only what the grammar accepts: an error is a bug
            grammar_error = not seq.matcher.consume_token(token) and token not in self.eos_set
            grammar_done = seq.matcher.is_stopped()  # complete: nothing may follow (as vLLM ends it)
        if grammar_error:
            seq.finish_reason = "abort"
        else:
            seq.finish_reason, seq.stop_reason = seq.stop_check(token, self.eos_set, self.max_model_len, grammar_done)
        if seq.finish_reason is None:
            return False
        out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
        out.kv_transfer_params = self.remove(seq)
        if self.requests[seq.request_id].finished:
            self._forget(seq.request_id)
        return True

    def _first_output(self, seq: Sequence, out: EngineCoreOutput) -> None:
        """A sequence's first output carries its prompt's cache hits, schedule time and prompt
        logprobs; the first sequence's also lets its siblings in (they share its prompt blocks)."""
        seq.started = True
        req = self.requests[seq.request_id]
        out.num_cached_tokens, out.first_scheduled = seq.num_cached_tokens, req.seqs[0].first_scheduled
        if seq.wants_prompt_logprobs:
            out.prompt_logprobs = seq.prompt_logprobs
        if seq.index == 0 and req.pending:
            for sib in reversed(req.pending):
                self.add(sib, front=True)
            req.pending = []
