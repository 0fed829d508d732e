"""EngineCore: the scheduler, KV block manager and model runner, stepped; token ids in, token ids out.

It knows nothing of text: the frontend tokenizes, detokenizes and checks stop strings (and aborts a
request here when one matches). The core checks what token ids decide: EOS, stop token ids,
max_tokens, max_model_len. With async scheduling, step n+1 is scheduled and dispatched before the
results of step n are read, so the host's work hides behind the device's.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from typing import Any

from jaxinfra.loading import load_tokenizer
from jaxinfra.models import LlamaModel
from jaxinfra.tokenizer import Tokenizer
from serve.config import EngineArgs
from serve.core.device_memory import memory_breakdown
from serve.core.expert_load import ExpertLoad
from serve.core.kv_cache import BlockManager
from serve.core.layout import resolve
from serve.core.loop_stream import LoopTokenStream, streams_in_loop
from serve.core.model_loading import load_engine_model
from serve.core.pooling.runner import build_pooler
from serve.core.request_state import CoreRequest
from serve.core.runner import InFlight, ModelRunner
from serve.core.scheduler import Scheduler
from serve.core.sequence import Sequence
from serve.core.spec_decode.proposer import PROPOSERS
from serve.core.step_data import SchedulerOutput
from serve.core.structured_output import GrammarCompiler, Matcher
from serve.kv_transfer.worker import KVTransferWorker
from serve.types import EngineCoreOutput, EngineCoreRequest, LoRARequest, SchedulerStats


class EngineBusy(ValueError):
    """A call that needs an idle engine came while requests were in flight."""


class EngineCore:
    def __init__(
        self,
        model: LlamaModel,
        args: EngineArgs,
        eos_token_ids: tuple[int, ...] = (),
        tokenizer: Tokenizer | None = None,
        stream: LoopTokenStream | None = None,
    ) -> None:
        """`tokenizer` serves structured outputs (loaded from the model's folder when needed if None);
        `stream`: decode loops' tokens stream through it as they are made, so streams may loop too."""
        cfg = model.cfg
        self.args = args
        self.tokenizer = tokenizer
        self.vocab_size = cfg.vocab_size
        spec = args.speculative()
        proposer = PROPOSERS[spec.method](spec, cfg, args) if spec is not None else None
        draft_cfg = proposer.draft_cfg if proposer is not None else None
        self.layout = layout = resolve(args, cfg, eos_token_ids, draft_cfg)
        self.max_model_len = layout.max_model_len
        self.eos_token_ids = layout.eos_token_ids
        self.block_manager = BlockManager(layout.num_blocks, layout.block_size, args.enable_prefix_caching)
        kv_transfer = args.kv_transfer()
        connector = kv_transfer.connector(layout.block_size) if kv_transfer is not None else None
        self.scheduler = Scheduler(
            self.block_manager,
            layout,
            proposer=proposer.host if proposer is not None else None,
            connector=connector,
            stream_loops=stream is not None,
        )
        self._grammar: GrammarCompiler | None = None
        self.runner = ModelRunner(
            model,
            layout,
            proposer=proposer,
            loop_tap=stream.device_tap if stream is not None else None,
            grammar=self.grammar,
        )
        self.kv_transfer = KVTransferWorker(connector, self.runner, self.scheduler) if connector is not None else None
        self.pooler = build_pooler(args, self.runner, layout) if args.runner == "pooling" else None
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        self.expert_load = ExpertLoad(moe_layers, cfg.num_experts) if moe_layers else None
        self.requests = self.scheduler.requests  # the scheduler owns request state
        self.inflight: collections.deque[InFlight] = collections.deque()
        self.step_time = self.step_wait = 0.0  # the last step's wall time and time spent waiting for the device
        self.applied_step = -1  # the last step id whose results were applied
        self.loop_stream = stream
        self.retiring_loras: set[int] = set()  # removed adapters that requests still run with

    # --- LoRA adapters ----------------------------------------------------------------------------
    def add_lora(self, request: LoRARequest) -> bool:
        """Read an adapter into host memory (vLLM's add_lora); a ValueError naming it if it cannot be
        served: LoRA off, not a PEFT LoRA folder, a rank above max_lora_rank, tensors that do not fit."""
        if self.runner.lora is None:
            raise ValueError(f"LoRA adapter {request.lora_name!r} requested, but the engine runs without enable_lora")
        self.runner.lora.host_adapter(request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter's host copy and slot; whether it was known. Requests already queued or running
        with it finish with it: it is forgotten when the last of them leaves (so its folder may go now)."""
        if self.runner.lora is None:
            return False
        if lora_int_id in self._lora_users():
            self.retiring_loras.add(lora_int_id)
            return True
        return self.runner.lora.remove(lora_int_id)

    def list_loras(self) -> list[int]:
        """The lora_int_ids of the adapters the core holds (in host memory or a slot; vLLM's list_loras)."""
        lora = self.runner.lora
        return sorted({*lora.host, *lora.slot_of}) if lora is not None else []

    def _lora_users(self) -> set[int]:
        """The adapters of the requests in the core."""
        return {r.request.lora_request.lora_int_id for r in self.requests.values() if r.request.lora_request}

    def _retire_loras(self) -> None:
        """Forget the removed adapters whose last request has left."""
        for lora_int_id in self.retiring_loras - self._lora_users():
            self.retiring_loras.discard(lora_int_id)
            self.remove_lora(lora_int_id)

    # --- requests ---------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest, matchers: list[Matcher] | None = None) -> None:
        """Queue a tokenized request; anything that cannot run is refused here (ValueError).
        `matchers`: its structured output's, one per sequence, when made beforehand off the step
        path (the core process's serve.core.grammar_queue); made here if None."""
        ids = req.prompt_token_ids
        if self.pooler is not None:
            raise ValueError("this engine runs runner='pooling': it embeds and scores, it does not generate")
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
        if req.lora_request is not None:
            self.add_lora(req.lora_request)
        p = req.params
        if any(t >= self.vocab_size for t in [*p.stop_token_ids, *(p.logit_bias or {})]):
            raise ValueError(f"SamplingParams.stop_token_ids and logit_bias keys must be in [0, {self.vocab_size})")
        seqs = [
            Sequence(
                req.request_id,
                i,
                ids,
                p,
                req.seed,
                req.cache_salt,
                (req.priority, req.arrival_time),
                req.tenant,
                req.weight,
                req.lora_request,
            )
            for i in range(p.n)
        ]
        if p.structured_outputs is not None:
            if matchers is None:
                matchers = [self.grammar().matcher(p.structured_outputs) for _ in seqs]
            for seq, matcher in zip(seqs, matchers):
                seq.matcher = matcher
        seqs[0].kv_transfer_params = req.kv_transfer_params  # siblings share its prompt blocks
        self.scheduler.add_request(CoreRequest(req, seqs, seqs[1:]))

    def abort_requests(self, request_ids: Iterable[str], sequences: Iterable[tuple[str, int]] = ()) -> None:
        """Stop requests, or single sequences of them, now and free their blocks (unknown or finished
        ones are ignored)."""
        for rid, index in [*((r, -1) for r in request_ids), *sequences]:
            self.scheduler.abort(rid, index)

    def grammar(self) -> GrammarCompiler:
        """The structured-output compiler, built with the first request that needs it."""
        if self._grammar is None:
            tok = self.tokenizer or load_tokenizer(self.args.tokenizer or self.args.model)
            if tok is None:
                raise ValueError("structured outputs need the model's tokenizer, and this model has none")
            self._grammar = GrammarCompiler(tok, self.vocab_size, self.eos_token_ids)
        return self._grammar

    def has_work(self) -> bool:
        return bool(self.requests) or bool(self.inflight)

    def poll_kv_transfers(self) -> bool:
        """While idle: free offered KV blocks that were pulled or expired; True if any were."""
        return self.kv_transfer is not None and self.kv_transfer.poll()

    # --- stepping ---------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule -> execute -> update: schedule the next step and dispatch it, then apply the
        previous step's results while it runs (all results first when scheduling is synchronous, or a
        running sequence needs its last token on the host). Returns what each sequence produced."""
        start = time.perf_counter()
        self.step_wait = 0.0
        outputs: dict[Sequence, EngineCoreOutput] = {}
        if self.inflight and (not self.args.async_scheduling or self.scheduler.needs_sync()):
            while self.inflight:
                self._update(self.inflight.popleft(), outputs)
        self.scheduler.now = time.monotonic()
        sched = self.scheduler.schedule()
        kv_meta = self.kv_transfer.before_step(sched) if self.kv_transfer is not None else None
        keep = 0
        if sched.seqs:
            if self.loop_stream is not None:
                self.loop_stream.register(sched.step_id, self._streamed_rows(sched))
            self.inflight.append(self.runner.dispatch(self.runner.prepare(sched)))
            keep = 1 if self.args.async_scheduling else 0
        else:
            self.runner.free_rows(sched)
        if self.kv_transfer is not None:
            self.kv_transfer.after_step(kv_meta)
        while len(self.inflight) > keep:
            self._update(self.inflight.popleft(), outputs)
        if self.retiring_loras:
            self._retire_loras()
        self.step_time = time.perf_counter() - start
        return list(outputs.values())

    def _streamed_rows(self, sched: SchedulerOutput) -> list[tuple[str, int, int] | None] | None:
        """A decode loop's rows whose tokens stream as made (`streams_in_loop`), each with the loop
        token that ends it by length (its budget, when the loop spends all of it; else 0)."""
        if sched.budgets is None:
            return None
        budget = self.scheduler.budget  # what is left after this loop: 0 for a row it ends
        return [
            (s.request_id, s.index, made if budget(s) == 0 else 0) if streams_in_loop(s, computed) else None
            for s, computed, made in zip(sched.seqs, sched.num_computed.tolist(), sched.budgets.tolist())
        ]

    def _update(self, inflight: InFlight, outputs: dict[Sequence, EngineCoreOutput]) -> None:
        t0 = time.perf_counter()
        inflight.wait()
        self.step_wait += time.perf_counter() - t0
        result = inflight.fetch()
        if self.expert_load is not None and result.expert_counts is not None:
            self.expert_load.observe(result.expert_counts)
        self.scheduler.update_from_output(inflight.batch.sched, result, outputs)
        self.applied_step = inflight.batch.sched.step_id

    # --- introspection ----------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        compiled, total = self.runner.shapes_compiled
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
            self.scheduler.spec.stats if self.scheduler.spec is not None else None,
            kv_transfer=self.kv_transfer.connector.get_kv_connector_stats() if self.kv_transfer is not None else None,
            expert_load=self.expert_load.stats() if self.expert_load is not None else None,
            shapes_compiled=compiled,
            shapes_total=total,
        )

    def check_invariants(self) -> None:
        self.block_manager.check_invariants([*self.scheduler.running, *self.scheduler.waiting])
        if not self.requests and not self.inflight:
            assert self.block_manager.num_free_blocks == self.block_manager.num_blocks, "idle engine holds blocks"

    def update_weights(self, source: Any) -> None:
        """New weights in place (ModelRunner.update_weights), and the prefix cache dropped (its blocks
        hold the old weights' KV). Only between requests: with any in flight an EngineBusy, so no
        output ever mixes two sets of weights."""
        self._check_idle()
        self.runner.update_weights(source)
        self.block_manager.reset_prefix_cache()

    def update_weights_from_disk(self, model_path: str) -> None:
        """update_weights from a checkpoint folder (HF safetensors) of the engine's model shape."""
        self._check_idle()  # before reading the checkpoint
        self.update_weights(load_engine_model(self.args, model_path))

    def pool(self, prompts: list[list[int]]) -> list[list[float]]:
        """Pooling prompts (token ids) run between steps, outside the scheduler: pooled vectors or a
        classifier's logits (PoolingRunner.run); no KV blocks are taken."""
        if self.pooler is None:
            raise ValueError("this model serves generation; pooling needs the server started with --runner pooling")
        return self.pooler.run(prompts)

    def _check_idle(self) -> None:
        if self.requests or self.inflight:
            raise EngineBusy(f"update_weights needs an idle engine: {len(self.requests)} requests are in flight")

    def utility(self, method: str, args: list[Any]) -> Any:
        """The calls a frontend may make on a core process."""
        calls: dict[str, Callable[..., Any]] = {
            "stats": lambda: self.stats(),
            "check_invariants": self.check_invariants,
            "reset_prefix_cache": self.block_manager.reset_prefix_cache,
            "memory": lambda: memory_breakdown(self.runner.weights, self.runner.kv_cache),
            "update_weights_from_disk": self.update_weights_from_disk,
            "pool": self.pool,
            "add_lora": lambda name, lora_int_id, path: self.add_lora(LoRARequest(name, lora_int_id, path)),
            "remove_lora": self.remove_lora,
            "list_loras": self.list_loras,
        }
        if method not in calls:
            raise ValueError(f"unknown utility call {method!r}")
        return calls[method](*args)
