"""A PEFT LoRA adapter folder read into host arrays shaped as the adapter slot pools take them
(jaxinfra.models.multi_lora.LoraPools), checked against the served model and the engine's rank limit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jaxinfra.checkpoint.hf import tensor_map
from jaxinfra.config import ModelConfig
from jaxinfra.lora.config import ATTENTION_MODULES
from jaxinfra.lora.peft import WEIGHTS_FILE, peft_config
from serve.types import LoRARequest


@dataclasses.dataclass(frozen=True)
class HostAdapter:
    """One adapter in host memory: per wrapped projection A [L, in, r] and B [L, r, out] (float32)."""

    request: LoRARequest
    rank: int
    scaling: float  # alpha / rank
    a: dict[str, np.ndarray]
    b: dict[str, np.ndarray]


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) sizes of every projection an adapter may wrap, flattened (q_proj: E -> H * D)."""
    e, q, kv, m = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "q_proj": (e, q),
        "k_proj": (e, kv),
        "v_proj": (e, kv),
        "o_proj": (q, e),
        "gate_proj": (e, m),
        "up_proj": (e, m),
        "down_proj": (m, e),
    }


def _hf_prefix(cfg: ModelConfig, layer: int, module: str) -> str:
    """PEFT's name of a layer's projection (without `.lora_A.weight`)."""
    path = ("layers", layer, "attn" if module in ATTENTION_MODULES else "mlp", module)
    return "base_model.model." + tensor_map(path, cfg.model_type).hf_name.removesuffix(".weight")


def read_adapter(request: LoRARequest, cfg: ModelConfig, max_rank: int, modules: tuple[str, ...]) -> HostAdapter:
    """The adapter at `request.lora_path` for model `cfg`; a ValueError naming the adapter when its folder
    is not a PEFT LoRA adapter, its rank exceeds `max_rank`, it wraps a projection outside `modules` (the
    engine's lora_target_modules), or a tensor is missing, extra or misshapen."""
    name, directory = request.lora_name, Path(request.lora_path)
    try:
        lora = peft_config(directory)
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {e}") from None
    if lora.rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {lora.rank}, above the engine's max_lora_rank ({max_rank})")
    shapes = module_shapes(cfg)
    outside = [m for m in shapes if m in lora.target_modules and m not in modules]  # in the model's order
    if outside:
        raise ValueError(
            f"LoRA adapter {name!r} wraps {', '.join(outside)}, outside the engine's lora_target_modules "
            f"(--lora-target-modules {','.join(modules)})"
        )
    a: dict[str, np.ndarray] = {}
    b: dict[str, np.ndarray] = {}
    with safe_open(str(directory / WEIGHTS_FILE), framework="numpy") as f:
        names = set(f.keys())
        for module in lora.target_modules:
            n_in, n_out = shapes[module]
            layers_a: list[np.ndarray] = []
            layers_b: list[np.ndarray] = []
            for layer in range(cfg.num_layers):
                prefix = _hf_prefix(cfg, layer, module)
                for tensor, shape, out in (
                    (f"{prefix}.lora_A.weight", (lora.rank, n_in), layers_a),
                    (f"{prefix}.lora_B.weight", (n_out, lora.rank), layers_b),
                ):
                    if tensor not in names:
                        raise ValueError(f"LoRA adapter {name!r}: missing tensor {tensor!r}")
                    value = f.get_tensor(tensor)
                    if value.shape != shape:
                        raise ValueError(
                            f"LoRA adapter {name!r}: tensor {tensor!r} has shape {list(value.shape)}, "
                            f"expected {list(shape)} for this model"
                        )
                    out.append(value.astype(np.float32).T)  # PEFT's [r, in] / [out, r]
                    names.discard(tensor)
            a[module], b[module] = np.stack(layers_a), np.stack(layers_b)
    if names:
        raise ValueError(f"LoRA adapter {name!r}: unexpected tensor(s) {sorted(names)[:8]}")
    return HostAdapter(request, lora.rank, lora.scale, a, b)
