"""The served model as EngineArgs ask for it: one loader for the core process, the offline engine and
weight updates from disk, and the persistent compilation cache they share."""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxinfra.loading import load_model
from jaxinfra.models import LlamaModel
from serve.config import EngineArgs


def enable_compilation_cache(directory: str | None) -> None:
    """JAX's persistent compilation cache: a restart reuses every compiled step shape. jax settles its
    cache at a process's first compile, so a process that compiled before (a notebook, a test run) has
    it settled again on the new folder."""
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    if jax.config.values.get("jax_compilation_cache_dir") != directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        compilation_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def load_engine_model(args: EngineArgs, path: str | None = None) -> LlamaModel:
    """args.model (or a checkpoint `path` of its shape) in args' dtype, attention and quantization."""
    return load_model(
        path or args.model,
        dtype=None if args.dtype == "auto" else args.dtype,
        attn_impl=args.attn_impl,
        seed=args.seed,
        quantization=args.quantization,
    )
