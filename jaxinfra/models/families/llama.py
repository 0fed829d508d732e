"""Llama 2/3/3.1: the base family (its config fields and tensor names are the registry's defaults)."""

from jaxinfra.models.families.registry import Family, attention_to_hf, register

LLAMA = register(Family("llama", "LlamaForCausalLM", config_to_hf=attention_to_hf))
