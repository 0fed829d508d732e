"""The one loader of dataclass configs (model, train, serve, quantize): a YAML mapping, then flags,
then dotted `key=value` overrides (values parsed as YAML); every error names the field."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    flags: dict[str, Any] | None = None,
    overrides: Sequence[str] = (),
    kind: str = "config field",
) -> T:
    """cls from `load_mapping`; `kind` names its fields in the unknown-field error."""
    return build_dataclass(cls, load_mapping(path, flags, overrides), kind=kind)


def load_mapping(
    path: str | Path | None = None, flags: dict[str, Any] | None = None, overrides: Sequence[str] = ()
) -> dict[str, Any]:
    """The YAML file's mapping (a file that must exist), updated by flags, then by key=value overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ValueError(f"config file {path} does not exist")
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping, got {data!r}")
    data.update(flags or {})
    for o in overrides:
        apply_override(data, o)
    return data


def build_dataclass(cls: type[T], data: Any, where: str = "", kind: str = "config field") -> T:
    """cls(**data), nested dataclasses built recursively; unknown fields are a ValueError naming them."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {kind}(s) {[f'{where}{k}' for k in unknown]}")
    kwargs = {
        k: build_dataclass(nested, v, f"{where}{k}.", kind)
        if (nested := _dataclass_of(hints[k])) is not None and v is not None
        else _coerce(hints[k], v, f"{where}{k}")
        for k, v in data.items()
    }
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{where or 'config'}: {e}") from None


def _dataclass_of(hint: Any) -> Any:
    """The dataclass a field holds (`X` or `X | None`), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)


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
