"""Dataclass configs from YAML mappings, with dotted `key=value` overrides (values parsed as YAML)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import yaml


def build_dataclass(cls: type, data: Any, where: str = "") -> Any:
    """cls(**data), nested dataclasses built recursively; unknown fields are a ValueError naming them."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown config field(s) {[f'{where}{k}' for k in unknown]}")
    kwargs = {
        k: build_dataclass(hints[k], v, f"{where}{k}.")
        if dataclasses.is_dataclass(hints[k])
        else _coerce(hints[k], v, f"{where}{k}")
        for k, v in data.items()
    }
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{where or 'config'}: {e}") from None


def _coerce(hint: Any, value: Any, where: str) -> Any:
    """YAML reads 1e-3 as a string and 1 as an int: make them floats where the field is a float."""
    if float in (hint, *typing.get_args(hint)) and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{where} must be a number, got {value!r}") from None
    return value


def apply_override(data: dict[str, Any], override: str) -> None:
    """'a.b=value' -> data['a']['b'] = yaml(value)."""
    if "=" not in override:
        raise ValueError(f"override {override!r} is not key=value")
    key, value = override.split("=", 1)
    *parents, leaf = key.strip().split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {override!r}: {p} is not a section")
    node[leaf] = yaml.safe_load(value)
