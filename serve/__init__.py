"""Serving: KV block manager, scheduler, jitted runner, sampler, offline API and async engine.

The names below load on first use, so a process that needs one light module of serve (the grammar
checker's child) does not import jax with the package."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve.config import EngineArgs
    from serve.engine.llm import LLM
    from serve.engine.llm_engine import LLMEngine
    from serve.sampling_params import SamplingParams
    from serve.types import CompletionOutput, LoRARequest, RequestOutput

_HOMES = {
    "EngineArgs": "serve.config",
    "LLMEngine": "serve.engine.llm_engine",
    "LLM": "serve.engine.llm",
    "LoRARequest": "serve.types",
    "CompletionOutput": "serve.types",
    "RequestOutput": "serve.types",
    "SamplingParams": "serve.sampling_params",
}
__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "LoRARequest", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'serve' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
