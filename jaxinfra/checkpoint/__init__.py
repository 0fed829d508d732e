"""Checkpoints: Hugging Face safetensors import/export here; orbax training checkpoints in
`jaxinfra.checkpoint.manager` (imported by training only: orbax and grain cost a serving process a second)."""

from jaxinfra.checkpoint.hf import export_hf, load_hf_model

__all__ = ["export_hf", "load_hf_model"]
