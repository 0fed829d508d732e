"""Hugging Face PEFT's LoRA format: adapter_config.json and adapter_model.safetensors, with PEFT's
tensor names (base_model.model.<HF name>.lora_A.weight [r, in], .lora_B.weight [out, r])."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxinfra.checkpoint.hf import tensor_map
from jaxinfra.lora.adapter import add_lora, lora_layers
from jaxinfra.lora.config import LoraConfig
from jaxinfra.models import LlamaModel

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# adapter_config.json fields whose other values change the math: (field, the one value we support)
_UNSUPPORTED: tuple[tuple[str, Any], ...] = (
    ("use_rslora", False),
    ("use_dora", False),
    ("fan_in_fan_out", False),
    ("bias", "none"),
    ("modules_to_save", None),
    ("layers_to_transform", None),
    ("rank_pattern", {}),
    ("alpha_pattern", {}),
)


def _prefix(model: LlamaModel, path: tuple) -> str:
    """PEFT's name of the module holding the weight at `path` (without `.lora_A.weight`)."""
    return "base_model.model." + tensor_map(path, model.cfg.model_type).hf_name.removesuffix(".weight")


def save_peft(model: LlamaModel, out_dir: str | Path, base_model: str | None = None) -> Path:
    """Write `model`'s adapters as a PEFT LoRA adapter folder that `peft.PeftModel.from_pretrained` loads."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("save_peft: the model has no adapters")
    first = layers[0][1]
    tensors: dict[str, np.ndarray] = {}
    for path, w in layers:
        prefix, r = _prefix(model, path), w.rank
        tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(np.asarray(w.lora_a[...]).reshape(-1, r).T)
        tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(np.asarray(w.lora_b[...]).reshape(r, -1).T)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": first.rank,
        "lora_alpha": first.scale * first.rank,
        "lora_dropout": first.dropout,
        "target_modules": sorted({path[-1] for path, _ in layers}),
        "inference_mode": True,
        "init_lora_weights": True,
        **dict(_UNSUPPORTED),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out


def peft_config(directory: str | Path) -> LoraConfig:
    """The LoraConfig of a PEFT adapter folder; a ValueError naming a field whose value we do not support."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{directory}: not a PEFT adapter folder (no {CONFIG_FILE})")
    config = json.loads(path.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type must be LORA, got {config.get('peft_type')!r}")
    for field, supported in _UNSUPPORTED:
        if (config.get(field) or supported) != supported:
            raise ValueError(f"{path}: {field}={config[field]!r} is not supported (only {supported!r})")
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        raise ValueError(f"{path}: target_modules must be a list of module names, got {targets!r}")
    return LoraConfig(
        config["r"], float(config["lora_alpha"]), float(config.get("lora_dropout") or 0.0), tuple(targets)
    )


def load_peft(model: LlamaModel, directory: str | Path) -> LlamaModel:
    """Add the adapters of a PEFT LoRA folder to `model` (in place); every tensor checked by name and shape."""
    directory = Path(directory)
    add_lora(model, peft_config(directory), nnx.Rngs(0))
    with safe_open(str(directory / WEIGHTS_FILE), framework="numpy") as f:
        names = set(f.keys())
        for path, w in lora_layers(model):
            prefix = _prefix(model, path)
            for name, var, shape in (
                (f"{prefix}.lora_A.weight", w.lora_a, (w.rank, int(np.prod(w.lora_a.shape[:-1])))),
                (f"{prefix}.lora_B.weight", w.lora_b, (int(np.prod(w.lora_b.shape[1:])), w.rank)),
            ):
                if name not in names:
                    raise ValueError(f"{directory}: missing tensor {name!r}")
                value = f.get_tensor(name)
                if value.shape != shape:
                    raise ValueError(
                        f"{directory}: tensor {name!r} has shape {list(value.shape)}, expected {list(shape)}"
                    )
                var.value = jnp.asarray(value.T.reshape(var.shape), dtype=model.cfg.dtype)  # PEFT's [r, in] / [out, r]
                names.discard(name)
    if names:
        raise ValueError(f"{directory}: unexpected tensor(s) {sorted(names)[:8]}")
    return model
