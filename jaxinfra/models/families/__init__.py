"""Model families, one module each: importing this package registers every module under it, so a
new Llama-like family is one new file (see registry.Family)."""

import importlib
import pkgutil

from jaxinfra.models.families.registry import FAMILIES, Family, TensorMap, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def family(model_type: str) -> Family:
    """The registered family of an HF model_type (a ValueError naming the supported ones if none)."""
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


__all__ = ["FAMILIES", "Family", "TensorMap", "family", "register"]
