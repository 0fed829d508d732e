"""jaxinfra: train and serve Llama-family LLMs on JAX, Flax NNX and Pallas."""

from jaxinfra.checkpoint import export_hf
from jaxinfra.config import ModelConfig, RopeScaling
from jaxinfra.generate import GenerationConfig, generate, generate_text
from jaxinfra.loading import load_config, load_model, load_tokenizer
from jaxinfra.models import LlamaModel
from jaxinfra.tokenizer import Tokenizer

__all__ = [
    "GenerationConfig",
    "LlamaModel",
    "ModelConfig",
    "RopeScaling",
    "Tokenizer",
    "export_hf",
    "generate",
    "generate_text",
    "load_config",
    "load_model",
    "load_tokenizer",
]
