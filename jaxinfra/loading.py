"""`load_model` / `load_tokenizer`: a local Hugging Face directory, a `jaxinfra train` run directory
(params-only restore of its latest checkpoint), or a preset name from configs/models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfra.checkpoint import load_hf_model
from jaxinfra.checkpoint.hf import abstract_model
from jaxinfra.config import DTYPES, ModelConfig, list_presets
from jaxinfra.models import LlamaModel
from jaxinfra.models.eagle import is_eagle_dir
from jaxinfra.models.llama import stack_layers, unstack_layers
from jaxinfra.quant.formats import QUANT_METHODS
from jaxinfra.tokenizer import Tokenizer

# A 4.5M-parameter Llama trained by this stack on the King James Bible (scripts/build_default_model.py).
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
DEFAULT_MODEL = str(DEFAULT_MODEL_DIR)
DEFAULT_MODEL_NAME = "kjv-small"  # the id `jaxinfra serve` gives it
# Its speculative draft: one narrow layer, same corpus and tokenizer (scripts/build_default_draft.py).
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parent / "default_draft"
DEFAULT_DRAFT_NAME = "default-draft"  # the name `model` takes for it in a speculative_config
# Its EAGLE head: one layer over its hidden states (configs/train/default_eagle.yaml).
DEFAULT_EAGLE_DIR = Path(__file__).resolve().parent / "default_eagle"
DEFAULT_EAGLE_NAME = "default-eagle"
ON_THE_FLY: dict[str, dict[str, Any]] = {
    "int8": {"method": "rtn", "bits": 8, "group_size": 0},
    "int4": {"method": "rtn", "bits": 4},
}
QUANTIZATION_CHOICES = (*QUANT_METHODS, *ON_THE_FLY)


def _resolve(path_or_preset: str | Path) -> Path | str:
    """A directory holding the HF config.json (a run directory resolves to its model/ folder), or a preset."""
    if str(path_or_preset) == DEFAULT_DRAFT_NAME:
        return DEFAULT_DRAFT_DIR
    if str(path_or_preset) == DEFAULT_EAGLE_NAME:
        return DEFAULT_EAGLE_DIR
    path = Path(path_or_preset)
    if is_run_dir(path):
        return path / "model"
    if path.is_dir():
        return path
    if str(path_or_preset) in list_presets():
        return str(path_or_preset)
    raise ValueError(
        f"model {str(path_or_preset)!r} is neither a local directory nor a preset ({', '.join(list_presets())})"
    )


def model_dir(path_or_name: str | Path) -> Path:
    """The local directory a model name or path stands for (a ValueError for a preset: no files)."""
    where = _resolve(path_or_name)
    if not isinstance(where, Path):
        raise ValueError(f"model {str(path_or_name)!r} is a preset, not a directory")
    return where


def is_eagle_head(path_or_name: str | Path) -> bool:
    """Whether a model name or path stands for an EAGLE head's directory (not a model)."""
    where = _resolve(path_or_name)
    return isinstance(where, Path) and is_eagle_dir(where)


def dtype_name(dtype: Any) -> str | None:
    """ "bfloat16", jnp.bfloat16, np.float32, jnp.dtype("float16")... as ModelConfig's dtype name."""
    if dtype is None:
        return None
    try:
        name = jnp.dtype(dtype).name
    except TypeError as e:
        raise ValueError(f"dtype must be one of {DTYPES} (a name or a dtype), got {dtype!r}") from e
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} (a name or a dtype), got {dtype!r}")
    return name


def load_model(
    path_or_preset: str | Path = DEFAULT_MODEL,
    dtype: Any = None,
    *,
    attn_impl: str | None = None,
    seed: int = 0,
    quantization: str | None = None,
) -> LlamaModel:
    """Weights from a local HF directory (quantized ones included), or random-init (seeded) weights for
    a preset. `dtype` is a name ("bfloat16") or a dtype (jnp.bfloat16, np.float32); None keeps the
    checkpoint's. `quantization` (vLLM's flag): the checkpoint's method, checked, or int8 / int4 to
    round a dense model's linears to W8A16 / W4A16 (group 128) as it loads."""
    if quantization is not None and quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES} or None, got {quantization!r}")
    dtype = dtype_name(dtype)
    where = _resolve(path_or_preset)
    stored = checkpoint_quantization(where) if isinstance(where, Path) else None
    if quantization in QUANT_METHODS and quantization != stored:
        raise ValueError(f"quantization={quantization!r}, but {path_or_preset} is {stored or 'not quantized'}")
    if quantization in ON_THE_FLY and stored is not None:
        raise ValueError(f"quantization={quantization!r} rounds a dense model; {path_or_preset} is already {stored}")
    if is_run_dir(Path(path_or_preset)):
        model = _load_run(Path(path_or_preset), dtype, attn_impl)
    elif isinstance(where, Path):
        model = load_hf_model(where, dtype=dtype, attn_impl=attn_impl)
    else:
        cfg = ModelConfig.from_preset(where)
        if dtype is not None:
            cfg = cfg.replace(dtype=dtype)
        model = LlamaModel(cfg, nnx.Rngs(seed), attn_impl)
    if quantization in ON_THE_FLY:
        from jaxinfra.quant.quantize import QuantizeConfig, quantize_model

        quantize_model(model, None, QuantizeConfig(**ON_THE_FLY[quantization]))
    return model


def checkpoint_quantization(directory: Path) -> str | None:
    """The quant_method of a HF directory's quantization_config (None when dense)."""
    config = directory / "config.json"
    if not config.is_file():
        return None
    qcfg = json.loads(config.read_text()).get("quantization_config")
    return None if qcfg is None else qcfg.get("quant_method")


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


def is_run_dir(path: Path) -> bool:
    return (path / "checkpoints").is_dir() and (path / "model" / "config.json").is_file()


def _load_run(run_dir: Path, dtype: str | None, attn_impl: str | None) -> LlamaModel:
    """The latest checkpoint's parameters only (no optimizer state), on the default device."""
    cfg = ModelConfig.from_hf(run_dir / "model")
    cfg = cfg.replace(dtype=dtype) if dtype else cfg
    graphdef, state = abstract_model(cfg, attn_impl)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def target(stacked: bool) -> dict:  # the checkpoint says how its layers are laid out
        layout = stack_layers(nnx.to_pure_dict(state)) if stacked else nnx.to_pure_dict(state)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=device), layout)

    from jaxinfra.checkpoint.manager import restore_params  # orbax: only for a run directory

    params, _, stacked = restore_params(run_dir / "checkpoints", target)
    params = unstack_layers(params, cfg.num_layers) if stacked else params
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: x.astype(cfg.dtype), params))
    return nnx.merge(graphdef, state)
