"""What a pooling server does with its model: the task (embed or classify), the pooling method and
normalization (vLLM's --runner, --convert and --pooler-config), resolved from the checkpoint's files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxinfra.checkpoint.hf import is_sequence_classifier
from jaxinfra.loading import model_dir

RUNNERS = ("generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
POOLING_TYPES = ("MEAN", "LAST", "CLS")
ST_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS", "pooling_mode_lasttoken": "LAST"}


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How hidden states become one vector: MEAN (over the prompt's tokens), LAST or CLS (the first
    token); `normalize`: scaled to unit length (embeddings only)."""

    pooling_type: str = "LAST"
    normalize: bool = True

    @classmethod
    def parse(cls, raw: dict[str, Any] | None, base: PoolerConfig | None = None) -> PoolerConfig:
        """`raw` (vLLM's --pooler-config JSON: pooling_type, normalize) over `base`; a ValueError names
        a bad key."""
        base = base or cls()
        if raw is None:
            return base
        if not isinstance(raw, dict) or set(raw) - {"pooling_type", "normalize"}:
            raise ValueError(f"EngineArgs.pooler_config takes pooling_type and normalize, got {raw!r}")
        kind = str(raw.get("pooling_type", base.pooling_type)).upper()
        if kind not in POOLING_TYPES:
            raise ValueError(f"EngineArgs.pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}")
        normalize = raw.get("normalize", base.normalize)
        if not isinstance(normalize, bool):
            raise ValueError(f"EngineArgs.pooler_config.normalize must be a bool, got {normalize!r}")
        return cls(kind, normalize)


@dataclasses.dataclass(frozen=True)
class PoolingSpec:
    """A pooling server's task ("embed" or "classify") and its pooler."""

    task: str
    pooler: PoolerConfig


def sentence_transformers_pooler(directory: Path) -> PoolerConfig | None:
    """The pooler a sentence-transformers checkpoint names (modules.json: its Pooling module's mode and
    whether a Normalize module follows), as vLLM reads it; None when the folder has none."""
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
    if pooling is None:
        return None
    settings = json.loads((directory / pooling.get("path", "") / "config.json").read_text())
    mode = next((kind for key, kind in ST_MODES.items() if settings.get(key)), "MEAN")
    return PoolerConfig(mode, any(m.get("type", "").endswith("Normalize") for m in modules))


def pooling_spec(directory: Path | None, convert: str, raw: dict[str, Any] | None) -> PoolingSpec:
    """The task and pooler for a model folder (None: a preset) under --convert and --pooler-config.
    convert auto: classify a *ForSequenceClassification checkpoint, else embed (vLLM's resolution)."""
    classifier = is_sequence_classifier(directory)
    task = ("classify" if classifier else "embed") if convert in ("auto", "none") else convert
    if task == "classify" and not classifier:
        raise ValueError("EngineArgs.convert classify needs a *ForSequenceClassification checkpoint (a score head)")
    found = sentence_transformers_pooler(directory) if directory is not None else None
    return PoolingSpec(task, PoolerConfig.parse(raw, found or PoolerConfig()))


def engine_pooling_spec(model: str, convert: str, raw: dict[str, Any] | None) -> tuple[PoolingSpec, Path | None]:
    """pooling_spec for EngineArgs' model (a folder, or a preset: no files) and the folder itself."""
    try:
        directory: Path | None = model_dir(model)
    except ValueError:  # a preset: no sentence-transformers config, no score head
        directory = None
    return pooling_spec(directory, convert, raw), directory
