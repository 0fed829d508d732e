"""Random PEFT LoRA adapters for the tiny test model, saved as a folder the engine and the server read."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxinfra
from jaxinfra.lora import LoraConfig, add_lora, lora_layers, save_peft
from tests.serve_helpers import PRESET

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def save_adapter(path, seed: int, rank: int, targets: tuple[str, ...] = ATTENTION + MLP, scale: float = 0.15):
    """Save a PEFT adapter with random A and B (N(0, scale^2), so it changes greedy outputs) at `path`;
    returns the model with the adapter attached."""
    model = add_lora(jaxinfra.load_model(PRESET), LoraConfig(rank, 2.0 * rank, 0.0, targets), nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for _, w in lora_layers(model):
        w.lora_a.value = jnp.asarray(scale * rng.standard_normal(w.lora_a.shape), w.lora_a.dtype)
        w.lora_b.value = jnp.asarray(scale * rng.standard_normal(w.lora_b.shape), w.lora_b.dtype)
    save_peft(model, path)
    return model
