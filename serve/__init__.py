"""Serving: KV block manager, scheduler, jitted runner, sampler, offline API and async engine."""

from serve.config import EngineArgs
from serve.engine import LLMEngine
from serve.llm import LLM
from serve.outputs import CompletionOutput, RequestOutput
from serve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "RequestOutput", "SamplingParams"]
