"""Model definitions."""

from jaxinfra.models.llama import LlamaModel

__all__ = ["LlamaModel"]
