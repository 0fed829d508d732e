"""`load_model` / `load_tokenizer`: a local Hugging Face directory or a preset name from configs/models."""

from __future__ import annotations

from pathlib import Path

from flax import nnx

from jaxinfra.checkpoint import load_hf_model
from jaxinfra.config import ModelConfig, list_presets
from jaxinfra.models import LlamaModel
from jaxinfra.tokenizer import Tokenizer

DEFAULT_MODEL = "tiny-llama"


def _resolve(path_or_preset: str | Path) -> Path | str:
    path = Path(path_or_preset)
    if path.is_dir():
        return path
    if str(path_or_preset) in list_presets():
        return str(path_or_preset)
    raise ValueError(f"model {str(path_or_preset)!r} is neither a local directory nor a preset "
                     f"({', '.join(list_presets())})")


def load_model(path_or_preset: str | Path = DEFAULT_MODEL, dtype: str | None = None, *,
               attn_impl: str | None = None, seed: int = 0) -> LlamaModel:
    """Weights from a local HF directory, or random-init (seeded) weights for a preset."""
    where = _resolve(path_or_preset)
    if isinstance(where, Path):
        return load_hf_model(where, dtype=dtype, attn_impl=attn_impl)
    cfg = ModelConfig.from_preset(where)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    return LlamaModel(cfg, nnx.Rngs(seed), attn_impl)


def load_tokenizer(path_or_preset: str | Path = DEFAULT_MODEL) -> Tokenizer:
    """The directory's tokenizer.json, or the byte-level tokenizer that presets use."""
    where = _resolve(path_or_preset)
    if isinstance(where, Path):
        return Tokenizer.from_dir(where)
    return Tokenizer.byte_level()


def load_config(path_or_preset: str | Path) -> ModelConfig:
    """The model config alone (no weights read)."""
    where = _resolve(path_or_preset)
    return ModelConfig.from_hf(where) if isinstance(where, Path) else ModelConfig.from_preset(where)
