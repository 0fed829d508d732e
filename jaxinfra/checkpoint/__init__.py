"""Checkpoints: Hugging Face safetensors import/export."""

from jaxinfra.checkpoint.hf import export_hf, load_hf_model

__all__ = ["export_hf", "load_hf_model"]
