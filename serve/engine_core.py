"""EngineCore: the scheduler, KV block manager and model runner, stepped; token ids in, token ids out.

It knows nothing of text: the frontend tokenizes, detokenizes and checks stop strings (and aborts a
request here when one matches). The core checks what token ids decide: EOS, stop token ids,
max_tokens, max_model_len. With async scheduling, step n+1 is scheduled and dispatched before the
results of step n are read, so the host's work hides behind the device's.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from jaxinfra.config import ModelConfig
from jaxinfra.loading import load_tokenizer
from jaxinfra.models import LlamaModel
from jaxinfra.tokenizer import Tokenizer
from serve.config import EngineArgs
from serve.core_types import EngineCoreOutput, EngineCoreRequest, SchedulerStats, TokenLogprobs
from serve.device_memory import memory_breakdown
from serve.kv_cache import BlockManager
from serve.runner import InFlight, LogprobArrays, ModelRunner, num_blocks_for_memory
from serve.sampling_params import MAX_BANNED_STOP_IDS
from serve.scheduler import Scheduler, SchedulerOutput
from serve.sequence import Sequence, Status
from serve.structured_output import GrammarCompiler, Matcher

DEFAULT_CPU_KV_MEMORY = 256 * 2**20


@dataclasses.dataclass
class CoreRequest:
    request: EngineCoreRequest
    seqs: list[Sequence]
    pending: list[Sequence]  # siblings (n > 1) admitted once the first has prefilled the prompt
    first_scheduled: float | None = None

    @property
    def finished(self) -> bool:
        return not self.pending and all(s.is_finished for s in self.seqs)


Logprob = tuple[float, np.ndarray, np.ndarray]  # log p(token), top ids, top logprobs


def kv_cache_blocks(cfg: ModelConfig, args: EngineArgs, bytes_limit: int | None = None, bytes_in_use: int = 0) -> int:
    """Blocks the engine gives the KV pools: `args.kv_cache_memory` bytes (256 MiB off GPU by default),
    else on a GPU the `gpu_memory_utilization` share of its allocator's `bytes_limit` less what is in
    use when the pools are sized (the weights). `jaxinfra plan-serve` calls this with planned bytes."""
    if args.kv_cache_memory is not None or bytes_limit is None:
        memory = args.kv_cache_memory or DEFAULT_CPU_KV_MEMORY
    else:
        memory = int(bytes_limit * args.gpu_memory_utilization) - bytes_in_use
    return num_blocks_for_memory(cfg, args.block_size, args.kv_cache_dtype, memory, args.attn_impl)


def _logprobs(token: int, lp: Logprob, k: int) -> TokenLogprobs:
    return TokenLogprobs(int(token), float(lp[0]), lp[1][:k].tolist(), lp[2][:k].tolist())


class EngineCore:
    def __init__(
        self,
        model: LlamaModel,
        args: EngineArgs,
        eos_token_ids: tuple[int, ...] = (),
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """`tokenizer` serves structured outputs (loaded from the model's folder when needed if None)."""
        cfg = model.cfg
        self.args = args
        self.tokenizer = tokenizer
        self.vocab_size = cfg.vocab_size
        self.max_model_len = args.max_model_len or min(cfg.max_position_embeddings, 4096)
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"EngineArgs.max_model_len ({self.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({cfg.max_position_embeddings})"
            )
        budget = args.max_num_batched_tokens or (2048 if args.enable_chunked_prefill else self.max_model_len)
        if budget < args.max_num_seqs and args.max_num_batched_tokens is not None:
            raise ValueError(
                f"EngineArgs.max_num_batched_tokens ({budget}) must be >= max_num_seqs ({args.max_num_seqs})"
            )
        if budget < self.max_model_len and not args.enable_chunked_prefill:
            raise ValueError(
                f"EngineArgs.max_num_batched_tokens ({budget}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is off"
            )
        budget = max(budget, args.max_num_seqs)
        num_blocks = args.num_gpu_blocks_override or self._blocks_from_memory(model, args)
        if num_blocks * args.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks x {args.block_size} tokens, fewer than "
                f"max_model_len ({self.max_model_len}); give it more memory or lower max_model_len"
            )
        self.eos_token_ids = tuple(dict.fromkeys((*cfg.eos_token_id, *eos_token_ids)))
        self.eos_set = frozenset(self.eos_token_ids)
        self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, args.max_num_seqs, budget, args.enable_chunked_prefill, args.scheduling_policy
        )
        self.runner = ModelRunner(
            model,
            block_size=args.block_size,
            num_blocks=num_blocks,
            max_model_len=self.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=budget,
            kv_cache_dtype=args.kv_cache_dtype,
            eos_token_ids=self.eos_token_ids,
            tensor_parallel_size=args.tensor_parallel_size,
            attn_impl=args.attn_impl,
            num_scheduler_steps=args.num_scheduler_steps,
        )
        self.requests: dict[str, CoreRequest] = {}
        self.inflight: collections.deque[InFlight] = collections.deque()
        self.step_time = self.step_wait = 0.0  # the last step's wall time and time spent waiting for the device

    @staticmethod
    def _blocks_from_memory(model: LlamaModel, args: EngineArgs) -> int:
        device = jax.devices()[0]
        if device.platform == "gpu" and args.kv_cache_memory is None:
            stats = device.memory_stats()
            return kv_cache_blocks(model.cfg, args, stats["bytes_limit"], stats["bytes_in_use"])
        return kv_cache_blocks(model.cfg, args)

    # --- requests ---------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest, matchers: list[Matcher] | None = None) -> None:
        """Queue a tokenized request; anything that cannot run is refused here (ValueError).
        `matchers`: its structured output's, one per sequence, when made beforehand off the step
        path (the core process's serve.grammar_queue); made here if None."""
        ids = req.prompt_token_ids
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if not ids:
            raise ValueError("prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, leaving no room to generate within max_model_len ({self.max_model_len})"
            )
        p = req.params
        if any(t >= self.vocab_size for t in [*p.stop_token_ids, *(p.logit_bias or {})]):
            raise ValueError(f"SamplingParams.stop_token_ids and logit_bias keys must be in [0, {self.vocab_size})")
        seqs = [
            Sequence(req.request_id, i, ids, p, req.seed, req.cache_salt, (req.priority, req.arrival_time))
            for i in range(p.n)
        ]
        if p.structured_outputs is not None:
            if matchers is None:
                matchers = [self.grammar().matcher(p.structured_outputs) for _ in seqs]
            for seq, matcher in zip(seqs, matchers):
                seq.matcher = matcher
        self.requests[req.request_id] = CoreRequest(req, seqs, seqs[1:])
        self.scheduler.add(seqs[0])

    def abort_requests(self, request_ids: Iterable[str], sequences: Iterable[tuple[str, int]] = ()) -> None:
        """Stop requests, or single sequences of them, now and free their blocks (unknown or finished
        ones are ignored)."""
        for rid, index in [*((r, -1) for r in request_ids), *sequences]:
            req = self.requests.get(rid)
            if req is None:
                continue
            for seq in req.seqs if index < 0 else req.seqs[index : index + 1]:
                if seq in req.pending:
                    req.pending.remove(seq)
                    seq.status = Status.FINISHED
                elif not seq.is_finished:
                    self.scheduler.remove(seq)
                    self.runner.release(seq)
                seq.finish_reason = seq.finish_reason or "abort"
            if req.finished:
                del self.requests[rid]

    def grammar(self) -> GrammarCompiler:
        """The structured-output compiler, built with the first request that needs it."""
        if self.runner.grammar is None:
            tok = self.tokenizer or load_tokenizer(self.args.tokenizer or self.args.model)
            if tok is None:
                raise ValueError("structured outputs need the model's tokenizer, and this model has none")
            self.runner.grammar = GrammarCompiler(tok, self.vocab_size, self.eos_token_ids)
        return self.runner.grammar

    def has_work(self) -> bool:
        return bool(self.requests) or bool(self.inflight)

    # --- stepping ---------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule and dispatch the next step, then read the previous one's results (all of them
        when scheduling is synchronous). Returns what each sequence produced."""
        start = time.perf_counter()
        self.step_wait = 0.0
        outputs: dict[Sequence, EngineCoreOutput] = {}
        if self.inflight and (self._must_sync() or not self.args.async_scheduling):
            self._drain(outputs)
        sched = self.scheduler.schedule()
        for victim in sched.preempted:
            self.runner.release(victim)
        if sched.scheduled:
            num_steps = self._decode_steps(sched)
            batch = self.runner.prepare(sched, num_steps)
            now = time.monotonic()
            for (seq, n), samples in zip(sched.scheduled, batch.samples):
                req = self.requests[seq.request_id]
                req.first_scheduled = req.first_scheduled or now
                if num_steps == 1:  # a decode loop's counts are known only from its results
                    seq.num_computed_tokens += n
                    seq.num_pending += int(samples)
                    # Key the blocks this step fills now: any step that reads them runs after it.
                    self.block_manager.cache_full_blocks(seq)
            self.inflight.append(self.runner.dispatch(batch))
            keep = 1 if self.args.async_scheduling else 0
        else:
            keep = 0
        while len(self.inflight) > keep:
            self._process(self.inflight.popleft(), outputs)
        self.step_time = time.perf_counter() - start
        return list(outputs.values())

    def _must_sync(self) -> bool:
        """Results must be read before scheduling: after a decode loop (counts unknown), and when a
        running sequence with penalties needs its last token in the host-built history, or one with
        a structured output in its matcher."""
        return self.inflight[-1].batch.num_steps > 1 or any(
            s.num_pending and (s.params.uses_penalties or s.matcher is not None) for s in self.scheduler.running
        )

    def _drain(self, outputs: dict[Sequence, EngineCoreOutput]) -> None:
        while self.inflight:
            self._process(self.inflight.popleft(), outputs)

    def _decode_steps(self, sched: SchedulerOutput) -> int:
        """How many decode steps to run in one jitted loop: num_scheduler_steps when the batch is
        decode-only, nothing waits, no sequence needs penalties or a token mask, and the pool has the
        blocks."""
        k = self.args.num_scheduler_steps
        if k == 1 or not sched.decode_only or self.scheduler.waiting:
            return 1
        seqs = [s for s, _ in sched.scheduled]
        if any(
            s.params.uses_penalties or s.matcher is not None or len(s.params.stop_token_ids) > MAX_BANNED_STOP_IDS
            for s in seqs
        ):
            return 1
        for s in seqs:
            if not self.block_manager.allocate_slots(s, min(k, self.runner.budget(s))):
                return 1
        return k

    def _process(self, inflight: InFlight, outputs: dict[Sequence, EngineCoreOutput]) -> None:
        t0 = time.perf_counter()
        inflight.wait()
        self.step_wait += time.perf_counter() - t0
        res = inflight.fetch()
        batch = inflight.batch
        bs = self.block_manager.block_size
        if batch.num_steps > 1:
            for i, seq in enumerate(batch.seqs):
                made = res.tokens[:, i]
                made = made[made >= 0].tolist()
                if seq.is_finished:
                    continue
                seq.num_computed_tokens += len(made)
                for k, token in enumerate(made):
                    lp = None if res.logprobs is None else (res.logprobs[0][k, i], *(a[k, i] for a in res.logprobs[1:]))
                    if self._append(seq, token, lp, outputs):
                        break
                else:
                    if min(seq.num_computed_tokens, len(seq.tokens)) // bs > len(seq.block_hashes):
                        self.block_manager.cache_full_blocks(seq)
            return
        if res.prompt_logprobs is not None:
            offsets = np.concatenate([[0], np.cumsum(batch.counts)])
            for i, seq in enumerate(batch.seqs):
                if seq.wants_prompt_logprobs:
                    self._collect_prompt_logprobs(
                        seq, res.prompt_logprobs, int(batch.starts[i]), int(batch.counts[i]), int(offsets[i])
                    )
        tokens, samples = res.tokens.tolist(), batch.samples.tolist()
        for i, seq in enumerate(batch.seqs):
            if seq.status is Status.FINISHED:
                continue
            if samples[i]:
                seq.num_pending -= 1
                lp = None if res.logprobs is None else (res.logprobs[0][i], res.logprobs[1][i], res.logprobs[2][i])
                if self._append(seq, tokens[i], lp, outputs):
                    continue
            if min(seq.num_computed_tokens, len(seq.tokens)) // bs > len(seq.block_hashes):
                self.block_manager.cache_full_blocks(seq)

    def _collect_prompt_logprobs(self, seq: Sequence, prompt: LogprobArrays, start: int, n: int, offset: int) -> None:
        k = seq.params.prompt_logprobs or 0
        if not seq.prompt_logprobs:
            seq.prompt_logprobs = [None]
        for j in range(start, start + n):
            if j + 1 >= seq.prompt_len or len(seq.prompt_logprobs) != j + 1:
                continue  # past the prompt, or already collected before a preemption
            row = offset + j - start
            seq.prompt_logprobs.append(
                _logprobs(seq.tokens[j + 1], (prompt[0][row], prompt[1][row], prompt[2][row]), k)
            )

    def _append(self, seq: Sequence, token: int, lp: Logprob | None, outputs: dict[Sequence, EngineCoreOutput]) -> bool:
        """Add a sampled token and check the stop rules (EOS and stop ids once min_tokens are out,
        max_tokens, max_model_len); True if the sequence finished."""
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
            out.new_logprobs.append(_logprobs(token, lp, seq.params.logprobs))
        produced = len(seq.tokens) - seq.prompt_len
        grammar_error = grammar_done = False
        if seq.matcher is not None:  # the mask allowed only what the grammar accepts: an error is a bug
            grammar_error = not seq.matcher.consume_token(token) and token not in self.eos_set
            grammar_done = seq.matcher.is_stopped()  # complete: nothing may follow (as vLLM ends it)
        if grammar_error:
            seq.finish_reason = "abort"
        elif produced >= seq.min_tokens and seq.check_eos and token in self.eos_set:
            seq.finish_reason = "stop"
        elif produced >= seq.min_tokens and token in seq.stop_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif grammar_done:
            seq.finish_reason = "stop"
        elif produced >= seq.max_output or len(seq.tokens) >= self.max_model_len:
            seq.finish_reason = "length"
        else:
            return False
        out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
        self.scheduler.remove(seq)
        self.runner.release(seq)
        if self.requests[seq.request_id].finished:
            del self.requests[seq.request_id]
        return True

    def _first_output(self, seq: Sequence, out: EngineCoreOutput) -> None:
        """A sequence's first output carries its prompt's cache hits, schedule time and prompt
        logprobs; the first sequence's also lets its siblings in (they share its prompt blocks)."""
        seq.started = True
        req = self.requests[seq.request_id]
        out.num_cached_tokens, out.first_scheduled = seq.num_cached_tokens, req.first_scheduled
        if seq.wants_prompt_logprobs:
            out.prompt_logprobs = seq.prompt_logprobs
        if seq.index == 0 and req.pending:
            for sib in reversed(req.pending):
                self.scheduler.add(sib, front=True)
            req.pending = []

    # --- introspection ----------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            bm.usage,
            bm.prefix_queries,
            bm.prefix_hits,
            self.scheduler.num_preemptions,
            bm.num_free_blocks,
            bm.num_blocks,
            self.runner.num_compilations,
        )

    def check_invariants(self) -> None:
        self.block_manager.check_invariants([*self.scheduler.running, *self.scheduler.waiting])
        if not self.requests and not self.inflight:
            assert self.block_manager.num_free_blocks == self.block_manager.num_blocks, "idle engine holds blocks"

    def utility(self, method: str, args: list[Any]) -> Any:
        """The calls a frontend may make on a core process."""
        calls = {
            "stats": lambda: self.stats(),
            "check_invariants": self.check_invariants,
            "reset_prefix_cache": self.block_manager.reset_prefix_cache,
            "memory": lambda: memory_breakdown(self.runner.weights, self.runner.kv_cache),
        }
        if method not in calls:
            raise ValueError(f"unknown utility call {method!r}")
        return calls[method](*args)
