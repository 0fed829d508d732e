"""LLMEngine: requests in, one scheduler + runner step at a time, RequestOutputs out."""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np

from jaxinfra.loading import load_model, load_tokenizer
from jaxinfra.models import LlamaModel
from jaxinfra.tokenizer import Tokenizer
from serve.config import EngineArgs
from serve.kv_cache import BlockManager
from serve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from serve.runner import ModelRunner, StepResult, num_blocks_for_memory
from serve.sampling_params import SamplingParams
from serve.scheduler import Scheduler
from serve.sequence import Sequence
from sharding import MeshConfig, make_mesh

DEFAULT_CPU_KV_MEMORY = 256 * 2**20


@dataclasses.dataclass
class EngineCounters:
    """Running totals for metrics (vLLM's counters)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    pending: list[Sequence]  # siblings (n > 1) admitted once the first has prefilled the prompt
    metrics: RequestMetrics

    @property
    def finished(self) -> bool:
        return not self.pending and all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, model: LlamaModel, tokenizer: Tokenizer | None, args: EngineArgs) -> None:
        cfg = model.cfg
        self.args = args
        self.model_config = cfg
        self.tokenizer = tokenizer
        self.max_model_len = args.max_model_len or min(cfg.max_position_embeddings, 4096)
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        budget = args.max_num_batched_tokens or (2048 if args.enable_chunked_prefill else self.max_model_len)
        if budget < args.max_num_seqs and args.max_num_batched_tokens is not None:
            raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({args.max_num_seqs})")
        budget = max(budget, args.max_num_seqs)
        num_blocks = args.num_gpu_blocks_override or self._blocks_from_memory(model, args)
        if num_blocks * args.block_size < self.max_model_len:
            raise ValueError(f"the KV cache holds {num_blocks} blocks x {args.block_size} tokens, fewer than "
                             f"max_model_len ({self.max_model_len}); give it more memory or lower max_model_len")
        self.eos_token_ids = tuple(dict.fromkeys([*cfg.eos_token_id, *(tokenizer.eos_token_ids if tokenizer else ())]))
        self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, budget, args.enable_chunked_prefill)
        mesh = None
        if args.tensor_parallel_size > 1:
            if len(jax.devices()) < args.tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size {args.tensor_parallel_size} needs that many devices; "
                                 f"{len(jax.devices())} available")
            mesh = make_mesh(MeshConfig(1, 1, args.tensor_parallel_size), jax.devices()[:args.tensor_parallel_size])
        self.runner = ModelRunner(model, block_size=args.block_size, num_blocks=num_blocks,
                                  max_model_len=self.max_model_len, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=budget, kv_cache_dtype=args.kv_cache_dtype,
                                  eos_token_ids=self.eos_token_ids, mesh=mesh)
        self.requests: dict[str, Request] = {}
        self.rng = np.random.default_rng(args.seed)
        self.counters = EngineCounters()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        model = load_model(args.model, dtype=None if args.dtype == "auto" else args.dtype, attn_impl=args.attn_impl,
                           seed=args.seed)
        tokenizer = load_tokenizer(args.tokenizer or args.model)
        return cls(model, tokenizer, args)

    @staticmethod
    def _blocks_from_memory(model: LlamaModel, args: EngineArgs) -> int:
        device = jax.devices()[0]
        if device.platform == "gpu" and args.kv_cache_memory is None:
            stats = device.memory_stats()
            memory = int(stats["bytes_limit"] * args.gpu_memory_utilization) - stats["bytes_in_use"]
        else:
            memory = args.kv_cache_memory or DEFAULT_CPU_KV_MEMORY
        return num_blocks_for_memory(model, args.block_size, args.kv_cache_dtype, memory)

    # --- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    *, cache_salt: str | None = None, arrival_time: float | None = None) -> Request:
        """Queue a request; a prompt that cannot fit max_model_len is rejected here (ValueError)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompt token ids")
            prompt_text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            prompt_text, ids = None, list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if not all(isinstance(t, (int, np.integer)) and 0 <= t < self.model_config.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {self.model_config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, leaving no room to generate within max_model_len "
                             f"({self.max_model_len})")
        seed = params.seed if params.seed is not None else int(self.rng.integers(2**31 - 1))
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [Sequence(request_id, i, ids, params, seed, cache_salt) for i in range(params.n)]
        if seqs[0].wants_prompt_logprobs:
            seqs[0].prompt_logprobs = [None]
        req = Request(request_id, prompt_text, ids, params, seqs, seqs[1:], RequestMetrics(arrival_time=now))
        self.requests[request_id] = req
        self.scheduler.add(seqs[0])
        self.counters.prompt_tokens += len(ids)
        return req

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks (unknown or finished ids are ignored)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        req.pending = []
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.finish_reason = "abort"
        self.counters.finished["abort"] = self.counters.finished.get("abort", 0) + 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --- stepping ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one device step, append sampled tokens; outputs of requests that progressed."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        result = self.runner.execute(sched)
        now = time.monotonic()
        touched: dict[str, Request] = {}
        offset = 0
        for i, (seq, n) in enumerate(sched.scheduled):
            req = self.requests[seq.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            start = seq.num_computed_tokens
            if result.prompt_logprob is not None and seq.wants_prompt_logprobs:
                self._collect_prompt_logprobs(seq, result, start, n, offset)
            offset += n
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # mid-prompt chunk: nothing sampled
            self._append_token(seq, result, i, now)
            touched[req.request_id] = req
            if seq.index == 0 and req.pending:
                for sib in reversed(req.pending):
                    self.scheduler.add(sib, front=True)
                req.pending = []
            if seq.finish_reason is not None:
                self.scheduler.remove(seq)
        outputs = []
        for req in touched.values():
            if req.finished:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
                for seq in req.seqs:
                    self.counters.finished[seq.finish_reason] = self.counters.finished.get(seq.finish_reason, 0) + 1
            if req.finished or req.params.output_kind == "cumulative":
                outputs.append(self.make_output(req))
        return outputs

    def _collect_prompt_logprobs(self, seq: Sequence, result: StepResult, start: int, n: int, offset: int) -> None:
        k = seq.params.prompt_logprobs or 0
        for j in range(start, start + n):
            if j + 1 >= seq.prompt_len or len(seq.prompt_logprobs) != j + 1:
                continue
            row = offset + j - start
            entry = {int(seq.tokens[j + 1]): float(result.prompt_logprob[row])}
            for t, lp in zip(result.prompt_top_ids[row][:k], result.prompt_top_logprobs[row][:k]):
                entry.setdefault(int(t), float(lp))
            seq.prompt_logprobs.append(entry)

    def _append_token(self, seq: Sequence, result: StepResult, row: int, now: float) -> None:
        out = result.sampled
        token = int(out.tokens[row])
        seq.tokens.append(token)
        self.counters.generation_tokens += 1
        req = self.requests[seq.request_id]
        if seq.index == 0 and req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if seq.params.logprobs is not None:
            lp = float(out.logprob[row])
            entry = {token: lp}
            k = seq.params.logprobs
            for t, v in zip(out.top_ids[row][:k], out.top_logprobs[row][:k]):
                entry.setdefault(int(t), float(v))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += lp
        self._check_stop(seq, token)

    def _decode(self, seq: Sequence) -> str:
        """The sequence's text, decoded again only when tokens arrived (and never after a stop string)."""
        if self.tokenizer is not None and seq.text_tokens != seq.num_output_tokens and seq.stop_reason is None:
            seq.text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
            seq.text_tokens = seq.num_output_tokens
        return seq.text

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if p.stop:
            self._decode(seq)
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return
            if token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
            hits = [(seq.text.find(s), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                seq.text = seq.text[: i + len(s)] if p.include_stop_str_in_output else seq.text[:i]
                seq.finish_reason, seq.stop_reason = "stop", s
                return
        if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def make_output(self, req: Request) -> RequestOutput:
        outs = [CompletionOutput(
            index=s.index, text=self._decode(s), token_ids=list(s.output_ids),
            cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
            logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in req.seqs]
        first = req.seqs[0]
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_ids,
            prompt_logprobs=list(first.prompt_logprobs) if first.wants_prompt_logprobs else None,
            outputs=outs, finished=req.finished, metrics=req.metrics, num_cached_tokens=first.num_cached_tokens)

    def live_sequences(self) -> list[Sequence]:
        """Sequences that may hold blocks (for invariant checks)."""
        return [*self.scheduler.running, *self.scheduler.waiting]

    def check_invariants(self) -> None:
        self.block_manager.check_invariants(self.live_sequences())
        if not self.requests:
            assert self.block_manager.num_free_blocks == self.block_manager.num_blocks, "idle engine holds blocks"
        assert math.isfinite(self.block_manager.usage)
