"""Input processor: checks and tokenizes a request into what the engine core runs."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jaxinfra.tokenizer import Tokenizer
from serve.core.scheduling_policy import check_weight
from serve.core.structured_output import GrammarCompiler
from serve.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from serve.types import EngineCoreRequest, LoRARequest

Prompt = str | list[int]


class InputProcessor:
    """Everything a request can get wrong is found here, as a ValueError naming it, before any of it
    reaches the engine core or the device."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        seed: int = 0,
        scheduling_policy: str = "fcfs",
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduling_policy = scheduling_policy
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.rng = np.random.default_rng(seed)
        self.grammar: GrammarCompiler | None = None

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt, or a token-id prompt checked against the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompt token ids")
            try:
                ids = self.tokenizer.encode(prompt, add_special_tokens)
            except (UnicodeError, TypeError, ValueError) as e:  # e.g. a lone surrogate
                raise ValueError(f"prompt is not valid text: {e}") from e
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            if not all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids
            ):
                raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size})")
            ids = [int(t) for t in ids]
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def process(
        self,
        request_id: str,
        prompt: Prompt | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        kv_transfer_params: dict[str, Any] | None = None,
        grammar_checked: bool = False,
        tenant: str = "",
        weight: float = 1.0,
        lora_request: LoRARequest | None = None,
    ) -> EngineCoreRequest:
        """The core's request; `grammar_checked`: the structured-output constraint was validated already
        (the server checks it in a child process: serve.engine.grammar_check); `tenant`, `weight`: its share
        under the fair policy; `lora_request`: its adapter (the core reads and checks it)."""
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, leaving no room to generate within max_model_len ({self.max_model_len})"
            )
        if params.use_beam_search:
            raise ValueError(
                "SamplingParams.use_beam_search runs through LLM.generate / LLM.beam_search, not add_request"
            )
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be ints in [0, {self.vocab_size})")
        if any(t >= self.vocab_size for t in params.logit_bias or {}):
            raise ValueError(f"SamplingParams.logit_bias keys must be token ids in [0, {self.vocab_size})")
        if params.structured_outputs is not None and not grammar_checked:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer, and this engine has none")
            if self.grammar is None:
                self.grammar = GrammarCompiler(self.tokenizer, self.vocab_size, self.tokenizer.eos_token_ids)
            self.grammar.validate(params.structured_outputs)
        if not isinstance(priority, int) or isinstance(priority, bool) or not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must be an int in [{INT64_MIN}, {INT64_MAX}]")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError("priority is set but the engine's scheduling_policy is not 'priority'")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string")
        if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
            raise ValueError("kv_transfer_params must be an object")
        if not isinstance(tenant, str):
            raise ValueError("tenant must be a string")
        check_weight(weight)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        seed = params.device_seed
        if seed is None:
            seed = int(self.rng.integers(2**31 - 1))
        return EngineCoreRequest(
            request_id,
            ids,
            params,
            seed,
            time.monotonic() if arrival_time is None else arrival_time,
            cache_salt,
            priority,
            kv_transfer_params,
            tenant,
            weight,
            lora_request,
        )
