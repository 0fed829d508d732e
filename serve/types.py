"""The plain data that crosses the process boundary: the msgspec messages between the frontend (tokenizer,
detokenizer, HTTP) and the engine core (msgpack over the local socket, never pickle; passed as is in one
process), and the request outputs shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from serve.config import EngineArgs
from serve.core.expert_load import ExpertLoadStats
from serve.core.spec_decode.stats import SpecDecodingStats
from serve.kv_transfer.stats import KVTransferStats
from serve.sampling_params import SamplingParams


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    """The adapter a request runs with: `lora_name` (what clients call it), `lora_int_id` (> 0, unique
    per loaded adapter: the engine keys its adapter slots and prefix-cache blocks by it) and
    `lora_path` (a PEFT adapter folder: adapter_config.json, adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError("LoRARequest.lora_path must be a non-empty string")


class EngineCoreRequest(msgspec.Struct, array_like=True, tag=True):
    """A request, already tokenized and validated by the frontend."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float
    cache_salt: str | None = None
    priority: int = 0  # with the priority policy: lower runs first
    kv_transfer_params: dict[str, Any] | None = None  # disaggregation: what the KV connector reads (vLLM's)
    tenant: str = ""  # with the fair policy: whose share of the engine the request draws on
    weight: float = 1.0  # the tenant's weight in that share
    lora_request: LoRARequest | None = None  # the adapter it runs with (multi-LoRA), None: the base model


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One position: log p(chosen token) and the top alternatives (ids, logprobs)."""

    token: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one sequence (request_id, index) produced since its last output."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" (set by the core)
    stop_reason: int | None = None  # the stop token id
    num_cached_tokens: int = 0  # first output only: prompt tokens found in the prefix cache
    first_scheduled: float | None = None  # first output only: when the request was first scheduled
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # index 0's first output, if asked
    kv_transfer_params: dict[str, Any] | None = None  # last output: where a prefill engine offers the KV


class SchedulerStats(msgspec.Struct, array_like=True):
    """The core's gauges and counters after a step (vLLM's scheduler stats)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_blocks: int
    num_compilations: int
    spec_decoding: SpecDecodingStats | None = None  # speculative decoding's counters, when on
    kv_transfer: KVTransferStats | None = None  # disaggregation's transfer counters, with a KV connector
    expert_load: ExpertLoadStats | None = None  # MoE models: token copies per expert
    shapes_compiled: int = 0  # step shapes warm-up has compiled so far (it goes on while the core serves)
    shapes_total: int = 0  # step shapes warm-up compiles (0: no warm-up, or one that ran each shape)


class EngineCoreOutputs(msgspec.Struct, array_like=True, tag=True):
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
    utility: tuple[int, str | None, object] | None = None  # (call id, error message, result)
    rejected: list[tuple[str, str]] = []  # (request id, why) the core refused


class CoreLaunch(msgspec.Struct, array_like=True):
    """What a core process is started with (on its stdin)."""

    args: EngineArgs
    eos_token_ids: list[int]
    warmup: bool
    input_fd: int  # the read end of the frontend's pipe to it (serve.core.transport)
    output_fd: int  # the write end of its pipe to the frontend: ready, outputs and heartbeats
    parent_pid: int  # the frontend: the core exits when it is no longer its parent (it may die before we read this)


class StartupError(msgspec.Struct, array_like=True, tag=True):
    message: str


class EngineCoreReady(msgspec.Struct, array_like=True, tag=True):
    """Sent once by a core process when its model is loaded and warmed up."""

    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]


class UtilityCall(msgspec.Struct, array_like=True, tag=True):
    """A named call on the core (stats, invariant checks, cache reset), answered in EngineCoreOutputs."""

    call_id: int
    method: str
    args: list[object] = []


class AbortRequests(msgspec.Struct, array_like=True, tag=True):
    """Drop whole requests, and single sequences (request id, index) that a stop string finished."""

    request_ids: list[str]
    sequences: list[tuple[str, int]] = []


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
