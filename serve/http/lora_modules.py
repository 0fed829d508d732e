"""The LoRA adapters a server serves by name (vLLM's --lora-modules and /v1/load_lora_adapter): each name's
LoRARequest (a lora_int_id never reused, so a name loaded again never meets the old adapter's prefix
cache), its folder and the base model it extends, as /v1/models lists them."""

from __future__ import annotations

import dataclasses
import itertools
import json

from serve.types import LoRARequest


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules entry: what clients call the adapter, its PEFT folder, and (vLLM's) the model
    it was trained on (default: the served model's name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """`name=path` or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`; a ValueError
    quoting `text` otherwise."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{text!r} is not valid JSON: {e}") from None
        fields = {"name", "path", "base_model_name"}
        if not isinstance(entry, dict) or set(entry) - fields or not {"name", "path"} <= set(entry):
            raise ValueError(f"{text!r} must have name and path (and base_model_name)")
        module = LoRAModulePath(entry["name"], entry["path"], entry.get("base_model_name"))
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"{text!r} must be name=path or a JSON object")
        module = LoRAModulePath(name.strip(), path.strip())
    for field in ("name", "path", "base_model_name"):
        value = getattr(module, field)
        if (value is not None or field != "base_model_name") and (not isinstance(value, str) or not value):
            raise ValueError(f"{text!r}: {field} must be a non-empty string")
    return module


@dataclasses.dataclass(frozen=True)
class ServedAdapter:
    request: LoRARequest
    base_model_name: str


class LoraRegistry:
    """The adapters served by name, in the order they were loaded; names being loaded are reserved."""

    def __init__(self, base_model_name: str) -> None:
        self.base_model_name = base_model_name
        self.adapters: dict[str, ServedAdapter] = {}
        self._loading: set[str] = set()
        self._ids = itertools.count(1)

    def get(self, name: str) -> LoRARequest | None:
        adapter = self.adapters.get(name)
        return adapter.request if adapter is not None else None

    def reserve(self, module: LoRAModulePath) -> LoRARequest:
        """The request a new adapter will be served with; a ValueError if its name is taken (by the base
        model, a served adapter or one being loaded). `commit` or `release` it after loading."""
        name = module.name
        if name == self.base_model_name:
            raise ValueError(f"The LoRA adapter name '{name}' is the base model's name.")
        if name in self.adapters or name in self._loading:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        self._loading.add(name)
        return LoRARequest(name, next(self._ids), module.path)

    def commit(self, request: LoRARequest, base_model_name: str | None) -> None:
        self._loading.discard(request.lora_name)
        self.adapters[request.lora_name] = ServedAdapter(request, base_model_name or self.base_model_name)

    def release(self, request: LoRARequest) -> None:
        self._loading.discard(request.lora_name)

    def remove(self, name: str) -> LoRARequest | None:
        """Stop serving `name`; its request, or None if no adapter has that name."""
        adapter = self.adapters.pop(name, None)
        return adapter.request if adapter is not None else None
