"""A request's LoRA adapter, vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`: plain data that
crosses the frontend/core boundary with the request."""

from __future__ import annotations

import msgspec


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
