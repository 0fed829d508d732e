"""Multi-LoRA in the engine core: PEFT adapter folders read into host memory, and the adapter slots
on the device they are copied into (least recently used swapped out)."""

from serve.core.lora.adapter_files import HostAdapter, module_shapes, read_adapter
from serve.core.lora.slots import AdapterSlots

__all__ = ["AdapterSlots", "HostAdapter", "module_shapes", "read_adapter"]
