"""Checkpoints: Hugging Face safetensors import/export; orbax training checkpoints."""

from jaxinfra.checkpoint.hf import export_hf, load_hf_model
from jaxinfra.checkpoint.manager import CheckpointConfig, TrainCheckpointer, restore_params

__all__ = ["CheckpointConfig", "TrainCheckpointer", "export_hf", "load_hf_model", "restore_params"]
