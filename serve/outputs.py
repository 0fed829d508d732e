"""Request outputs shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

import dataclasses
from typing import Any

# Per position: {token_id: logprob} holding the sampled (or actual prompt) token and the top-n.
Logprobs = list[dict[int, float]]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Logprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) of one request's life, for TTFT / ITL / queue-time metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None  # a prefill engine's: where the prompt's KV is offered
