"""LoRA: low-rank adapters on a frozen model, trained by `jaxinfra train` (`lora:`), in PEFT's format."""

from jaxinfra.lora.adapter import (
    LoraLinear,
    LoraParam,
    add_lora,
    apply_lora,
    lora_layers,
    merge_lora,
    unload_lora,
)
from jaxinfra.lora.config import TARGET_MODULES, LoraConfig
from jaxinfra.lora.peft import load_peft, peft_config, save_peft

__all__ = [
    "TARGET_MODULES",
    "LoraConfig",
    "LoraLinear",
    "LoraParam",
    "add_lora",
    "apply_lora",
    "load_peft",
    "lora_layers",
    "merge_lora",
    "peft_config",
    "save_peft",
    "unload_lora",
]
