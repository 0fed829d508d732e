"""LLMEngine: the offline engine in one process. Input processor -> engine core -> output processor,
one `step()` at a time (the server puts the core in a process of its own: serve.engine.async_engine)."""

from __future__ import annotations

from jaxinfra.loading import load_tokenizer
from jaxinfra.models import LlamaModel
from jaxinfra.tokenizer import Tokenizer
from serve.config import EngineArgs
from serve.core.engine_core import EngineCore
from serve.core.model_loading import enable_compilation_cache, load_engine_model
from serve.engine.input_processor import InputProcessor, Prompt
from serve.engine.output_processor import OutputProcessor
from serve.sampling_params import SamplingParams
from serve.types import LoRARequest, RequestOutput, SchedulerStats


class LLMEngine:
    def __init__(self, model: LlamaModel, tokenizer: Tokenizer | None, args: EngineArgs) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.core = EngineCore(model, args, tokenizer.eos_token_ids if tokenizer else (), tokenizer)
        self.max_model_len = self.core.max_model_len
        self.input_processor = InputProcessor(
            tokenizer, model.cfg.vocab_size, self.max_model_len, args.seed, args.scheduling_policy
        )
        self.output_processor = OutputProcessor(tokenizer)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        enable_compilation_cache(args.compilation_cache_dir)
        return cls(load_engine_model(args), load_tokenizer(args.tokenizer or args.model), args)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (with `lora_request`: run by that adapter); bad input (an over-long or empty
        prompt, unknown ids, an adapter that cannot be served) is a ValueError here."""
        params = params or SamplingParams()
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        req = self.input_processor.process(
            request_id,
            prompt,
            params,
            cache_salt=cache_salt,
            arrival_time=arrival_time,
            priority=priority,
            lora_request=lora_request,
        )
        self.core.add_request(req)
        self.output_processor.add_request(
            request_id, prompt if isinstance(prompt, str) else None, req.prompt_token_ids, params, req.arrival_time
        )

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks (unknown or finished ids are ignored)."""
        self.output_processor.abort(request_id)
        self.core.abort_requests([request_id])

    def unfinished_request_ids(self) -> list[str]:
        return list(self.output_processor.requests)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.core.has_work()

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of requests that progressed (per their output kind)."""
        processed = self.output_processor.process(self.core.step())
        if processed.to_abort:
            self.core.abort_requests([], processed.to_abort)
        return processed.outputs

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    def check_invariants(self) -> None:
        self.core.check_invariants()
