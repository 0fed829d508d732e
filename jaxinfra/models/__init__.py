"""Model definitions."""

from jaxinfra.models.llama import LlamaModel
from jaxinfra.models.options import ForwardOptions

__all__ = ["ForwardOptions", "LlamaModel"]
