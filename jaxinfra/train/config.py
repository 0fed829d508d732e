"""`jaxinfra train` configuration: nested dataclasses loaded from configs/train/*.yaml, with dotted
`key=value` overrides from the command line (values parsed as YAML: `optim.learning_rate=1e-3`)."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from jaxinfra.checkpoint.manager import CheckpointConfig
from jaxinfra.data import DataConfig
from jaxinfra.train.step import OptimConfig, TrainConfig
from sharding import PRESETS, MeshConfig


@dataclasses.dataclass
class RunConfig:
    model: str = "tiny-llama"  # preset name, model YAML file, or HF directory (continue from its weights)
    tokenizer: str | None = None  # directory with tokenizer.json; default: the model's
    out_dir: str = "runs/default"  # checkpoints/, metrics.jsonl, tb/, loss.png, hf/
    steps: int = 1000
    batch_size: int = 8  # global rows of data.seq_len tokens per step
    seed: int = 0  # parameter init
    sharding: str = "fsdp"  # preset of logical-axis rules (sharding/rules.py)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    microbatches: int = 1  # gradient accumulation: the batch in this many pieces
    remat: str = "none"  # per decoder layer: none | full | save_dots
    compute_dtype: str = "bfloat16"  # matmuls and activations; master weights stay float32
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    eval_every: int = 100
    eval_batches: int = 8  # global batches of the held-out split per evaluation
    log_every: int = 10
    peak_tflops: float | None = None  # per-device peak for MFU; default: known GPUs' bf16 dense peak
    attn_impl: str | None = None  # pallas | reference | xla | cudnn (default: pallas on GPU)
    export_hf: bool = True  # write <out_dir>/hf (safetensors + tokenizer) at the end

    def __post_init__(self) -> None:
        self.train_config()  # checks remat, microbatches and compute_dtype
        for name in ("steps", "batch_size", "eval_every", "eval_batches", "log_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.sharding not in PRESETS:
            raise ValueError(f"sharding must be one of {sorted(PRESETS)}, got {self.sharding!r}")

    def train_config(self) -> TrainConfig:
        """What the sharded step takes."""
        return TrainConfig(self.optim, self.microbatches, self.remat, self.compute_dtype)


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown config field(s) {[f'{where}{k}' for k in unknown]}")
    kwargs = {
        k: _build(hints[k], v, f"{where}{k}.")
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


def load_run_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """A RunConfig from YAML (or the defaults) plus overrides; optim.total_steps defaults to steps."""
    data: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ValueError(f"--config: {path} does not exist")
        data = yaml.safe_load(Path(path).read_text()) or {}
    for o in overrides:
        apply_override(data, o)
    return build_run_config(data)


def build_run_config(data: dict[str, Any]) -> RunConfig:
    """A RunConfig from a nested dict; optim.total_steps defaults to steps."""
    cfg = _build(RunConfig, data, "")
    if "total_steps" not in (data.get("optim") or {}):
        cfg.optim = dataclasses.replace(cfg.optim, total_steps=cfg.steps)
    return cfg


def dump_run_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
