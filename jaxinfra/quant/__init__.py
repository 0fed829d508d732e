"""Weight and activation quantization: RTN, AWQ, GPTQ, SmoothQuant, and the checkpoint formats vLLM reads."""

from jaxinfra.quant.qlinear import QuantizedLinear, QuantParam, Weight, linear

__all__ = ["QuantParam", "QuantizedLinear", "Weight", "linear"]
