"""Engine arguments with vLLM's names and meanings, loadable from configs/serve/*.yaml."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from jaxinfra.loading import DEFAULT_MODEL


@dataclasses.dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"                  # auto = the checkpoint's dtype
    seed: int = 0
    block_size: int = 16
    max_model_len: int | None = None     # default: the model's max_position_embeddings, capped at 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: 2048 with chunked prefill, else max_model_len
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: int | None = None   # bytes for the KV pool off GPU (default 256 MiB)
    kv_cache_dtype: str = "auto"         # auto | int8
    tensor_parallel_size: int = 1
    attn_impl: str | None = None         # pallas | reference (default: pallas on GPU)

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"EngineArgs.block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"EngineArgs.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"EngineArgs.kv_cache_dtype must be auto or int8, got {self.kv_cache_dtype!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"EngineArgs.{name} must be a positive int or None, got {value!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"EngineArgs.max_num_seqs must be a positive int, got {self.max_num_seqs!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"EngineArgs.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"EngineArgs.tensor_parallel_size must be a positive int, got {self.tensor_parallel_size!r}")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "EngineArgs":
        data = yaml.safe_load(Path(path).read_text()) or {}
        data.update(overrides)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown engine argument(s) {unknown}")
        return cls(**data)
