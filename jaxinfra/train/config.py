"""`jaxinfra train` configuration: nested dataclasses loaded from configs/train/*.yaml, with dotted
`key=value` overrides from the command line (values parsed as YAML: `optim.learning_rate=1e-3`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from jaxinfra.checkpoint.manager import CheckpointConfig
from jaxinfra.data import DataConfig
from jaxinfra.lora import LoraConfig
from jaxinfra.train.step import TrainConfig
from jaxinfra.yaml_config import build_dataclass, load_mapping
from sharding import PRESETS, MeshConfig


@dataclasses.dataclass(frozen=True)
class RunConfig(TrainConfig):
    """A training run: the sharded step's TrainConfig fields, plus the model, data, mesh and logging."""

    model: str = "tiny-llama"  # preset name, model YAML file, or HF directory (continue from its weights)
    tokenizer: str | None = None  # directory with tokenizer.json; default: the model's
    out_dir: str = "runs/default"  # checkpoints/, metrics.jsonl, tb/, loss.png, hf/
    steps: int = 1000
    batch_size: int = 8  # global rows of data.seq_len tokens per step
    seed: int = 0  # parameter init
    sharding: str = "fsdp"  # preset of logical-axis rules (sharding/rules.py)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    eval_every: int = 100
    eval_batches: int = 8  # global batches of the held-out split per evaluation
    log_every: int = 10
    peak_tflops: float | None = None  # per-device peak for MFU; default: known GPUs' bf16 dense peak
    attn_impl: str | None = None  # pallas | reference | xla | cudnn (default: pallas on GPU)
    profile_steps: int = 0  # > 0: trace this many steps with jax.profiler into out_dir/tb (TensorBoard)
    profile_start: int = 3  # first traced step (after compilation and warm-up)
    export_hf: bool = True  # write <out_dir>/hf (safetensors + tokenizer) at the end
    # a model: train an EAGLE draft head over its frozen hidden states instead (`model` is then not
    # used: the head takes the target's shape), written to <out_dir>/hf (jaxinfra/train/eagle.py)
    eagle_target: str | None = None
    # low-rank adapters on a pretrained `model` (an HF or run directory): only they train, and the
    # run writes them to <out_dir>/adapter in PEFT's format instead of the whole model to <out_dir>/hf
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        super().__post_init__()  # checks remat, microbatches, compute_dtype, ...
        for name in ("profile_steps", "profile_start"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        for name in ("steps", "batch_size", "eval_every", "eval_batches", "log_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.sharding not in PRESETS:
            raise ValueError(f"sharding must be one of {sorted(PRESETS)}, got {self.sharding!r}")


def load_run_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """A RunConfig from YAML (or the defaults) plus overrides; optim.total_steps defaults to steps."""
    return build_run_config(load_mapping(path, overrides=overrides))


def build_run_config(data: dict[str, Any]) -> RunConfig:
    """A RunConfig from a nested dict; optim.total_steps defaults to steps."""
    cfg = build_dataclass(RunConfig, data)
    if "total_steps" not in (data.get("optim") or {}):
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, total_steps=cfg.steps))
    return cfg


def dump_run_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
